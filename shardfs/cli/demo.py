"""`shardfs demo`: make a tiny ImageFolder dataset, shard it, serve it on loopback with nginx,
mount it, read one shuffled epoch with torchvision's ImageFolder, and say what happened."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardfs.devtools.datagen import make_imagefolder
from shardfs.devtools.nginx import Nginx, NginxError
from shardfs.pack import pack

CLASSES, PER_CLASS, MEAN_KB = 10, 40, 20


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def _epoch(root: Path) -> tuple[int, float, str, int]:
    """One shuffled epoch over ImageFolder(root) with 2 DataLoader workers (or plain reads):
    images, seconds, what read them, and the bytes of the files read."""
    began = time.monotonic()
    try:
        import torch
        from torchvision import datasets, transforms
    except ImportError:
        files = [p for p in root.rglob("*") if p.is_file()]
        total = sum(len(p.read_bytes()) for p in files)
        return len(files), time.monotonic() - began, "plain reads", total
    tf = transforms.Compose([transforms.Resize((64, 64)), transforms.ToTensor()])
    ds = datasets.ImageFolder(str(root), transform=tf)
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
    seen = sum(images.shape[0] for images, _ in loader)
    total = sum(os.path.getsize(path) for path, _ in ds.samples)  # each decoded whole, once
    return seen, time.monotonic() - began, f"ImageFolder: {len(ds.classes)} classes", total


def _mount(source: str, mnt: Path, cache: Path) -> int:
    result = subprocess.run([sys.executable, "-m", "shardfs", "mount", source, str(mnt),
                             "--cache-dir", str(cache), "--no-warm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"mount failed:\n{result.stderr}")
    _say(result.stdout.strip())
    match = re.search(r"daemon pid (\d+)", result.stdout)
    return int(match.group(1)) if match else 0


def _unmount(mnt: Path, pid: int) -> None:
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    deadline = time.monotonic() + 10
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)


def run_demo(args: argparse.Namespace) -> int:
    keep = args.workdir is not None
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardfs-demo-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    mnt, server, pid = work / "mnt", None, 0
    try:
        _say(f"working in {work}")
        t = time.monotonic()
        files = make_imagefolder(work / "images", classes=CLASSES, per_class=PER_CLASS,
                                 mean_kb=MEAN_KB, seed=0)
        size = sum(f.stat().st_size for f in files)
        _say(f"made {len(files)} JPEGs in {CLASSES} classes, {size / 1e6:.1f} MB "
             f"({time.monotonic() - t:.1f} s)")
        www = work / "www"
        shards = pack(work / "images", www, prefix="train", shard_size=1 << 20, shuffle=True)
        _say(f"packed them into {len(shards.shards)} shards + index files in {www}")
        try:
            server = Nginx(www, work / "nginx").start()
            source = shards.pattern.replace(str(www), server.url)
            _say(f"serving the shards with nginx at {server.url}")
        except (NginxError, FileNotFoundError) as exc:
            source = shards.pattern
            _say(f"nginx unavailable ({exc}); mounting the local shard files instead")
        mnt.mkdir(exist_ok=True)
        _say(f"shardfs mount '{source}' {mnt}")
        pid = _mount(source, mnt, work / "cache")
        seen, took, what, nbytes = _epoch(mnt / "train")
        stats = json.loads(os.getxattr(mnt, "user.shardfs.stats"))
        _say(f"one shuffled epoch through the mount: {seen} images in {took:.2f} s "
             f"({seen / took:.0f} files/s; {what})")
        _say(f"bytes read through the mount: {nbytes:,}; fetched from the "
             f"source: {stats['bytes_fetched']:,} (dataset {stats['dataset_bytes']:,} bytes in "
             f"{stats['shards']} shards); the daemon answered reads for "
             f"{stats['bytes_served']:,} of them, the kernel's page cache the rest")
        if server is not None:
            tar_requests = [r for r in server.access_log()
                            if r.uri.endswith(".tar") and r.range != "bytes=0-0"]
            _say(f"nginx served {len(tar_requests)} requests for shard data "
                 f"(a per-file object-store mount would need {seen})")
        seen2, took2, _, _ = _epoch(mnt / "train")
        _say(f"second epoch (cached): {seen2} images in {took2:.2f} s "
             f"({seen2 / took2:.0f} files/s)")
        return 0
    except Exception as exc:  # the demo reports, cleans up, and fails visibly
        print(f"shardfs demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _unmount(mnt, pid)
        if server is not None:
            server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
        _say("unmounted and cleaned up")
