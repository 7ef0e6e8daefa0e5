"""DDP training (gloo, CPU) over ImageFolder on shardfs mounts, with DistributedShardSampler.

The only shardfs-specific line is the sampler (`--sampler shard`):

    sampler = DistributedShardSampler(dataset)                # instead of DistributedSampler

or, to keep DistributedSampler's exact order (`--sampler lookahead`):

    sampler = Lookahead(DistributedSampler(dataset))
    loader = DataLoader(dataset, batch_size=..., sampler=sampler, num_workers=...)

Runs N ranks on this machine with torch.multiprocessing (default 2), or under torchrun when
started by it. Give one DATA dir per rank (rank r uses DATA[r % len(DATA)]) to simulate nodes
that each have their own mount of the same shards:

    python examples/train_ddp.py /tmp/node0/mnt/train /tmp/node1/mnt/train --epochs 2
    torchrun --nproc-per-node 2 examples/train_ddp.py /mnt/imagenet/train --epochs 2

With --out DIR each rank writes DIR/rank<R>.json: per epoch the sample indices it read, its
batch count, and what its mount fetched (used by tests/test_ddp.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms


def mount_stats(path: str) -> dict | None:
    """The shardfs counters of the mount holding `path`, or None when it is not on one."""
    path = os.path.realpath(path)
    while not os.path.ismount(path) and path != "/":
        path = os.path.dirname(path)
    try:
        return json.loads(os.getxattr(path, "user.shardfs.stats"))
    except OSError:
        return None


def tiny_model(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes),
    )


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)  # several ranks share this machine's cores
    data = args.data[rank % len(args.data)]
    tf = transforms.Compose([transforms.Resize((args.image_size, args.image_size)),
                             transforms.ToTensor()])
    dataset = datasets.ImageFolder(data, transform=tf)
    if args.sampler == "shard":
        from shardfs.torch import DistributedShardSampler

        sampler = DistributedShardSampler(dataset, seed=args.seed, window=args.window,
                                          local_world_size=args.local_world_size)
        if rank == 0:
            print(f"DistributedShardSampler: {len(sampler.map.shards)} shards, window "
                  f"{sampler.window}, {sampler.num_nodes} node(s)", flush=True)
    elif args.sampler == "lookahead":
        from shardfs.torch import Lookahead

        # The stock order, exactly; the mount is told which files come next.
        sampler = Lookahead(DistributedSampler(dataset, seed=args.seed))
    else:
        sampler = DistributedSampler(dataset, seed=args.seed)
    order = getattr(sampler, "sampler", sampler)  # Lookahead: its wrapped sampler's order
    # Persistent workers: ranks started by mp.spawn would spawn (not fork) fresh workers each
    # epoch, re-importing torch every time.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(tiny_model(len(dataset.classes)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        before = mount_stats(data)
        began = time.monotonic()
        batches = seen = 0
        for images, targets in loader:
            opt.zero_grad()
            loss_fn(model(images), targets).backward()  # all-reduce: ranks must agree on counts
            opt.step()
            batches += 1
            seen += len(targets)
        took = time.monotonic() - began
        dist.barrier()
        after = mount_stats(data)
        record = {"epoch": epoch, "batches": batches, "samples": seen, "seconds": took,
                  "indices": list(order)}  # the order the loader consumed (same epoch)
        line = f"rank {rank} epoch {epoch}: {batches} batches, {seen} samples in {took:.2f} s"
        if before is not None and after is not None:
            record["bytes_fetched"] = after["bytes_fetched"] - before["bytes_fetched"]
            record["dataset_bytes"] = after["dataset_bytes"]
            record["requests"] = after["source"]["requests"] - before["source"]["requests"]
            record["member_fetches"] = (after["reader"]["member_fetches"]
                                        - before["reader"]["member_fetches"])
            line += (f"; its mount fetched {record['bytes_fetched'] / 1e6:.1f} MB "
                     f"({record['bytes_fetched'] / after['dataset_bytes']:.2f} x dataset) in "
                     f"{record['requests']} requests ({record['member_fetches']} single members)")
        print(line, flush=True)
        epochs.append(record)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [os.path.relpath(p, data) for p, _ in dataset.samples]
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "world": world, "data": data, "paths": paths, "epochs": epochs}))


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", nargs="+", help="ImageFolder root(s); rank r uses DATA[r % len]")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    p.add_argument("--sampler", choices=("shard", "distributed", "lookahead"), default="shard",
                   help="DistributedShardSampler, stock DistributedSampler, or "
                   "Lookahead(DistributedSampler): the stock order announced to the mount")
    p.add_argument("--window", type=int, default=None,
                   help="shards shuffled together (default: 4, fewer if the cache is small)")
    p.add_argument("--local-world-size", type=int, default=None,
                   help="ranks per node sharing one mount (default: $LOCAL_WORLD_SIZE, else 1)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="collective timeout (s)")
    p.add_argument("--out", help="write per-rank records here")
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    else:
        mp.spawn(_spawned, args=(args.nproc, _free_port(), args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
