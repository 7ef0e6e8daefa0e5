"""A plain ImageFolder training loop, as found in countless scripts, over a shardfs mount.

The only shardfs-specific line is the sampler (`--sampler shard-aware`):

    sampler = ShardAwareSampler(dataset)                         # instead of shuffle=True
    loader = DataLoader(dataset, batch_size=..., sampler=sampler, num_workers=...)

Each epoch prints its throughput and, when DATA is on a shardfs mount, what the mount fetched
from the source during that epoch (read from the mount root's `user.shardfs.stats` xattr).

    python examples/train_imagefolder.py /tmp/demo/mnt/train --epochs 2 --sampler shard-aware
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
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
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


def read_bytes(path: str) -> int:
    """--io-only loader: read the file, skip decoding (measures the data path alone)."""
    with open(path, "rb") as f:
        return len(f.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", help="ImageFolder root, e.g. /mnt/imagenet/train")
    p.add_argument("epochs", type=int, nargs="?", default=1)
    p.add_argument("--epochs", dest="epochs_opt", type=int, help="same as EPOCHS")
    p.add_argument("--sampler", choices=("random", "shard-aware"), default="random")
    p.add_argument("--window", type=int, default=None,
                   help="shards shuffled together (default: 4, fewer if the cache is small)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--io-only", action="store_true",
                   help="read the files but do not decode or train (measures I/O)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    epochs = args.epochs_opt if args.epochs_opt is not None else args.epochs
    torch.manual_seed(args.seed)

    if args.io_only:
        dataset = datasets.ImageFolder(args.data, loader=read_bytes)
    else:
        tf = transforms.Compose([transforms.Resize((args.image_size, args.image_size)),
                                 transforms.ToTensor()])
        dataset = datasets.ImageFolder(args.data, transform=tf)

    if args.sampler == "shard-aware":
        from shardfs.torch import ShardAwareSampler

        began = time.monotonic()
        sampler = ShardAwareSampler(dataset, seed=args.seed, window=args.window)
        print(f"ShardAwareSampler: {len(sampler.map.shards)} shards (learned in "
              f"{time.monotonic() - began:.2f} s), window {sampler.window}", flush=True)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers)
    else:
        sampler = None
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                            num_workers=args.workers)

    model = tiny_model(len(dataset.classes))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        before = mount_stats(args.data)
        began = time.monotonic()
        seen, total_loss = 0, 0.0
        for images, targets in loader:
            seen += len(targets)
            if args.io_only:
                continue
            opt.zero_grad()
            loss = loss_fn(model(images), targets)
            loss.backward()
            opt.step()
            total_loss += loss.item() * len(targets)
        took = time.monotonic() - began
        line = (f"epoch {epoch}: {seen} samples in {took:.2f} s ({seen / took:.0f} samples/s)"
                + ("" if args.io_only else f", loss {total_loss / max(seen, 1):.3f}"))
        after = mount_stats(args.data)
        if before is not None and after is not None:
            fetched = after["bytes_fetched"] - before["bytes_fetched"]
            requests = after["source"]["requests"] - before["source"]["requests"]
            members = after["reader"]["member_fetches"] - before["reader"]["member_fetches"]
            shards = (after["reader"]["shard_fetches_done"]
                      - before["reader"]["shard_fetches_done"])
            ratio = fetched / after["dataset_bytes"]
            line += (f"; mount fetched {fetched / 1e6:.1f} MB ({ratio:.2f} x dataset) in "
                     f"{requests} requests: {shards} whole shards, "
                     f"{members} single members")
        print(line, flush=True)


if __name__ == "__main__":
    main()
