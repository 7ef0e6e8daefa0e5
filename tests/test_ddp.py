"""Real DDP (2 processes, gloo) over two mounts of the same shards on nginx: "two nodes".

Runs examples/train_ddp.py, so the example is tested too. Each rank has its own mount and cache
dir, as two nodes would; the index files are published next to the shards and the mounts use
--no-warm, so everything a mount fetches is caused by the epoch's reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Dataset, Mounter, brace, shard_names

pytest.importorskip("torch")
pytest.importorskip("torchvision")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def publish_with_index(ds: Dataset, root: Path) -> None:
    dest = root / "data"
    dest.mkdir(parents=True, exist_ok=True)
    for name in shard_names(ds):
        shutil.copy(ds.shard_dir / name, dest / name)
        shutil.copy(ds.shard_dir / f"{name}.shardfs.idx", dest / f"{name}.shardfs.idx")


def run_ddp(ds: Dataset, nginx, mounter: Mounter, tmp_path: Path, sampler: str,
            epochs: int, *mount_args: str) -> tuple[list[dict], list]:
    publish_with_index(ds, nginx.root)
    source = brace(ds, f"{nginx.url}/data")
    mounts = [mounter.mount([source], None, None, "--no-warm", *mount_args) for _ in range(2)]
    for m in mounts:
        assert m.stats()["bytes_fetched"] == 0  # the published indexes were used
    out = tmp_path / "ddp-out"
    env_cmd = [sys.executable, str(EXAMPLE), *(str(m.mountpoint / "train") for m in mounts),
               "--epochs", str(epochs), "--sampler", sampler, "--workers", "0",
               "--image-size", "16", "--batch-size", "8", "--timeout", "60",
               "--out", str(out)]
    result = subprocess.run(env_cmd, capture_output=True, text=True, timeout=180,
                            env={**_env(), "SHARDFS_SAMPLER_CACHE": str(tmp_path / "maps")})
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, mounts


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def check_correct(ranks: list[dict], n: int) -> None:
    assert ranks[0]["paths"] == ranks[1]["paths"]  # same dataset order on both "nodes"
    assert len(ranks[0]["paths"]) == n
    for e0, e1 in zip(ranks[0]["epochs"], ranks[1]["epochs"], strict=True):
        assert e0["batches"] == e1["batches"] and e0["samples"] == e1["samples"]
        assert e0["samples"] == len(e0["indices"]) == len(e1["indices"])
        both = e0["indices"] + e1["indices"]
        assert sorted(both) == list(range(n))  # 120 samples, 2 ranks: no padding needed


def test_shard_sampler_each_node_fetches_about_half(dataset, nginx, mounter: Mounter,
                                                    tmp_path: Path):
    ranks, mounts = run_ddp(dataset, nginx, mounter, tmp_path, "shard", epochs=2)
    n = dataset.shards.nfiles
    check_correct(ranks, n)
    total = dataset.shards.nbytes
    biggest = max(s.size for s in dataset.shards.shards)
    first = [r["epochs"][0]["bytes_fetched"] for r in ranks]
    for fetched in first:
        # Half the shards, plus the one shard the node boundary may cut.
        assert 0.25 * total <= fetched <= 0.5 * total + biggest + 64 * 1024, (first, total)
    assert sum(first) <= total + biggest + 64 * 1024
    # The epochs are re-dealt: the two epochs' orders differ on each rank.
    for r in ranks:
        assert r["epochs"][0]["indices"] != r["epochs"][1]["indices"]
    for m in mounts:
        stats = m.stats()
        assert stats["reader"]["eio"] == 0
        assert stats["reader"]["member_fetches"] <= 8  # whole shards, not one file at a time


def test_stock_distributed_sampler_is_correct_but_every_node_reads_everything(
        dataset, nginx, mounter: Mounter, tmp_path: Path):
    ranks, mounts = run_ddp(dataset, nginx, mounter, tmp_path, "distributed", epochs=1)
    check_correct(ranks, dataset.shards.nfiles)
    total = dataset.shards.nbytes
    for r, m in zip(ranks, mounts, strict=True):
        assert r["epochs"][0]["bytes_fetched"] >= 0.75 * total
        assert m.stats()["reader"]["eio"] == 0


def test_lookahead_keeps_each_ranks_stock_order(dataset, nginx, mounter: Mounter,
                                                tmp_path: Path):
    """Lookahead(DistributedSampler) on two "nodes" whose caches are smaller than the dataset:
    each rank reads exactly DistributedSampler's order, mostly out of its mount's lookahead."""
    from torch.utils.data import DistributedSampler

    ranks, mounts = run_ddp(dataset, nginx, mounter, tmp_path, "lookahead", 2,
                            "--cache-size", "256KiB")
    n = dataset.shards.nfiles
    check_correct(ranks, n)
    for r, rank in enumerate(ranks):
        for epoch, record in enumerate(rank["epochs"]):
            stock = DistributedSampler(range(n), num_replicas=2, rank=r, seed=0)
            stock.set_epoch(epoch)
            assert record["indices"] == list(stock)
    for m in mounts:
        stats = m.stats()
        assert stats["reader"]["eio"] == 0
        # Mostly: a read that overtakes its announced GET (a busy CI machine: once 80 hits of
        # 90 reads) is a miss and read as usual; without Lookahead there would be no hits.
        assert stats["lookahead"]["hits"] >= 0.8 * stats["reader"]["reads"], stats["lookahead"]
