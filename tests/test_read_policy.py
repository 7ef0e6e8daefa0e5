"""The read policy through a real mount: when whole shards are fetched, when member reads are
made instead, and that a downloaded shard must match its index's sha256 (README, "How reads
work" and "Consistency")."""

from __future__ import annotations

import io
import os
import random
import shutil
import tarfile
import time
from pathlib import Path

import pytest

from shardfs.devtools.nginx import Nginx
from tests.conftest import Dataset, Mount, Mounter, brace, shard_names
from tests.faultproxy import FaultProxy
from tests.test_mount import publish

MiB = 1 << 20


def _wait_for(m: Mount, done, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    stats = m.stats()
    while not done(stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = m.stats()
    return stats


def test_random_reads_larger_than_cache_switch_to_member_reads(dataset: Dataset, nginx: Nginx,
                                                               mounter: Mounter):
    """Uniformly random reads over a dataset larger than the cache: the working set (the last
    32 reads) spans every shard, so whole shards stop paying and members are fetched alone."""
    publish(dataset, nginx.root)
    shard_size = max(s.size for s in dataset.shards.shards)
    budget = 3 * shard_size
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--cache-size", str(budget), "--max-fetches", "64")
    files = list(dataset.files().items())
    random.Random(5).shuffle(files)
    for rel, data in files:
        assert (m.mountpoint / rel).read_bytes() == data, rel
    stats = _wait_for(m, lambda s: s["shards_fetching"] == 0)
    r = stats["reader"]
    assert stats["working_set_reads"] == 32  # 12 files per shard, clamped up to 32
    assert stats["working_set_bytes"] > stats["cache_budget_bytes"]  # why: members alone
    # Only the first few reads, before the working set outgrew the budget, start whole-shard
    # fetches; everything after is read member by member. Without the switch every shard is
    # fetched (and evicted) again and again.
    assert r["shard_fetches_started"] <= 3, r
    assert r["member_fetches"] >= len(files) // 2, r
    assert stats["evictions"] == 0, stats
    fetched = r["shard_bytes"] + r["member_bytes"]
    assert fetched <= 1.5 * stats["bytes_served"], (fetched, stats["bytes_served"])


def _big_shard(path: Path) -> dict[str, bytes]:
    """A shard of ~20 MiB: a small member at the start, one far beyond wait_ahead (16 MiB)."""
    rng = random.Random(7)
    members = {"head.bin": rng.randbytes(4096), "pad.bin": rng.randbytes(20 * MiB),
               "tail.bin": rng.randbytes(4096)}
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return members


@pytest.mark.parametrize("split", ["on", "off"])
def test_read_far_ahead_of_the_frontier_reads_the_member(nginx: Nginx, mounter: Mounter,
                                                         split: str):
    """A read more than wait_ahead (16 MiB) past a running fetch's frontier does not wait for
    the download: it splits the fetch (its member by a GET of its own, which the download will
    not fetch again), or with --split-fetches off fetches its member alongside."""
    (nginx.root / "big").mkdir()
    members = _big_shard(nginx.root / "big" / "big-0.tar")
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([f"{proxy.url}/big/big-{{0..0}}.tar"], None, None, "--no-warm",
                          "--timeout", "30", "--split-fetches", split)
        # The whole-shard fetch (the next request) stalls after 64 KiB: its frontier stays
        # there while the tail, ~20 MiB further, is read.
        proxy.stall(60, after_bytes=64 * 1024, times=1)
        assert (m.mountpoint / "head.bin").read_bytes() == members["head.bin"]
        assert (m.mountpoint / "tail.bin").read_bytes() == members["tail.bin"]
        stats = m.stats()
        r = stats["reader"]
        assert stats["shards_fetching"] == 1  # the stalled download is still running ...
        assert r["shard_fetches_started"] == 1 and r["waits"] >= 1, r  # ... head waited on it
        if split == "on":  # the tail's bytes came by a GET of the fetch's own
            assert r["split_reads"] == 1 and r["member_fetches"] == 0, r
        else:
            assert r["split_reads"] == 0, r
            assert r["member_fetches"] == 1 and r["member_bytes"] == 4096, r
        tail_off = int(os.getxattr(m.mountpoint / "tail.bin", "user.shardfs.offset"))
        tail_requests = [q for q in proxy.requests
                         if q.headers.get("range", "").startswith(f"bytes={tail_off}-")]
        assert len(tail_requests) == 1, [q.headers.get("range") for q in proxy.requests]
        if split == "on":
            assert tail_requests[0].headers["range"] == f"bytes={tail_off}-{tail_off + 4095}"


@pytest.mark.parametrize("verify", ["auto", "sha256"])
def test_whole_shard_download_is_checked_against_the_index(dataset: Dataset, nginx: Nginx,
                                                           mounter: Mounter, verify: str):
    """A served shard whose bytes differ from what its published index recorded (same size,
    same ETag: a silent corruption on the server) never enters the cache as complete. The
    index (`shardfs pack`'s) records both digests: by default the CRC-32C is checked,
    with `--verify sha256` the sha256."""
    dest = nginx.root / "data"
    dest.mkdir()
    for name in shard_names(dataset):
        shutil.copy(dataset.shard_dir / name, dest / name)
        shutil.copy(dataset.shard_dir / f"{name}.shardfs.idx", dest / f"{name}.shardfs.idx")
    bad = dest / shard_names(dataset)[0]
    st = bad.stat()
    data = bytearray(bad.read_bytes())
    _, last_off, last_size, _ = max(dataset.shards.shards[0].members, key=lambda m: m[1])
    data[last_off + last_size // 2] ^= 0xFF  # in the last member's data: headers stay valid
    bad.write_bytes(bytes(data))
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))  # nginx's ETag/Last-Modified unchanged
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--verify", verify)
    first = min((r for r in dataset.files()
                 if os.getxattr(m.mountpoint / r, "user.shardfs.shard").decode()
                 .endswith("/" + bad.name)),
                key=lambda r: int(os.getxattr(m.mountpoint / r, "user.shardfs.offset")))
    assert (m.mountpoint / first).read_bytes() == dataset.files()[first]
    stats = _wait_for(m, lambda s: s["shards_fetching"] == 0)
    assert stats["reader"]["fetch_errors"] == 1, stats["reader"]
    assert stats["reader"]["shard_fetches_done"] == 0 and stats["shards_cached"] == 0, stats
    assert [p.name for p in (m.cache_dir / "shards").iterdir()] == []  # no final name, no .part
    kind = "crc32c" if verify == "auto" else "sha256"
    assert f"content differs from its index ({kind})" in m.log()
    # Not downloaded whole again (it would not match again): the shard's other files come from
    # member reads.
    other = max((r for r in dataset.files()
                 if os.getxattr(m.mountpoint / r, "user.shardfs.shard").decode()
                 .endswith("/" + bad.name)),
                key=lambda r: int(os.getxattr(m.mountpoint / r, "user.shardfs.offset")))
    (m.mountpoint / other).read_bytes()
    after = _wait_for(m, lambda s: s["shards_fetching"] == 0)
    assert after["reader"]["shard_fetches_started"] == 1, after["reader"]
    assert after["reader"]["fetch_errors"] == 1
    assert after["reader"]["member_fetches"] > stats["reader"]["member_fetches"]
