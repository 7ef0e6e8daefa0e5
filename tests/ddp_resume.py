"""A DDP job (2 ranks, gloo, torch.multiprocessing) that stops mid-epoch and resumes, for
tests/test_resume.py.

    python tests/ddp_resume.py DATA0 DATA1 --samplers lookahead,shard --phase first|rest
        --state DIR --out DIR [--stop-after 3] [--epoch 1]

For each sampler in turn: `first`: each rank reads `--stop-after` batches of epoch `--epoch`
through a StatefulDataLoader and saves the loader's state_dict to DIR/<sampler>-rank<R>.pt;
`rest`: a new job loads it and reads the rest of the epoch. Each rank writes
OUT/<sampler>-rank<R>.json: the indices it read and (in `rest`) the rank's uninterrupted order
of that epoch from a fresh sampler. The loader has no worker processes: ranks started by
torch.multiprocessing would start theirs by importing torch again (DataLoader workers with
StatefulDataLoader are tested in tests/test_resume.py without DDP).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision import datasets

from shardfs.torch import DistributedShardSampler, Lookahead

BATCH = 4


class Indexed(Dataset):
    """Sample i is i, after reading its file: the batches say which indices were read."""

    def __init__(self, root: str) -> None:
        self.folder = datasets.ImageFolder(root)
        self.samples = self.folder.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> int:
        with open(self.samples[i][0], "rb") as f:
            f.read()
        return i


def make_sampler(kind: str, ds: Indexed, seed: int = 0):
    if kind == "lookahead":
        return Lookahead(DistributedSampler(ds, seed=seed), ds)
    return DistributedShardSampler(ds, seed=seed, local_world_size=1)


def run(rank: int, kind: str, args: argparse.Namespace) -> dict:
    ds = Indexed(args.data[rank])
    sampler = make_sampler(kind, ds)
    sampler.set_epoch(args.epoch)
    loader = StatefulDataLoader(ds, sampler=sampler, batch_size=BATCH, num_workers=0)
    state_file = Path(args.state) / f"{kind}-rank{rank}.pt"
    indices: list[int] = []
    record: dict = {"rank": rank, "batch_size": BATCH}
    if args.phase == "first":
        for k, batch in enumerate(loader):
            indices += batch.tolist()
            if k + 1 == args.stop_after:
                break
        state_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(loader.state_dict(), state_file)
    else:
        loader.load_state_dict(torch.load(state_file, weights_only=False))
        indices = [i for batch in loader for i in batch.tolist()]
        fresh = make_sampler(kind, ds)
        fresh.set_epoch(args.epoch)
        record["expected"] = list(getattr(fresh, "sampler", fresh))
    record["indices"] = indices
    dist.barrier()
    return record


def _spawned(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for kind in args.samplers.split(","):
            record = run(rank, kind, args)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{kind}-rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data", nargs=2)
    p.add_argument("--samplers", default="lookahead,shard")
    p.add_argument("--phase", choices=("first", "rest"), required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-after", type=int, default=3)
    p.add_argument("--epoch", type=int, default=1)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_spawned, args=(port, args), nprocs=2)


if __name__ == "__main__":
    main()
