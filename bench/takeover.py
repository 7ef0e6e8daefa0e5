"""The gap a daemon's death leaves: kill -9 -> the next read answered through the mount.

`python -m bench.takeover [--kills 5] [--workers 1] [--files 400]`: mounts random files packed
into shards (file:// source copied into the cache as before `--in-place auto` became the
default, `--no-warm`, through the CLI, so with the holder), and for each
kill: waits until the holder's spare daemon stands by, drops the page cache of every file,
starts 8 reader threads over every file (sha256-checked), SIGKILLs the daemon (the pid of the
stats) and times from the kill until a probe read of a file whose pages were dropped, started
once every process of the old daemon (its workers too) is gone, returns.
Side by side, the same probe read without a kill (the baseline). Prints each gap, the median,
and the readers' errors and wrong files (both must be 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardfs.devtools.pagecache import drop_pages
from shardfs.pack import pack


def _make_data(root: Path, files: int, seed: int) -> tuple[Path, dict[str, str], int]:
    rng = random.Random(seed)
    tree = root / "tree"
    sha = {}
    for i in range(files):
        rel = f"train/c{i % 8}/f{i:05d}.bin"
        data = rng.randbytes(rng.randint(4_000, 16_000))
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
        sha[rel] = hashlib.sha256(data).hexdigest()
    result = pack(tree, root / "shards", prefix="train", shard_size=512 * 1024, shuffle=True,
                  seed=seed)
    return root / "shards", sha, len(result.shards)


def _stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.shardfs.stats"))


def _spare_standing_by(holder: int) -> bool:
    for child in Path(f"/proc/{holder}/task/{holder}/children").read_text().split():
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"--standby-fd" in cmd and "pipe" in Path(f"/proc/{child}/wchan").read_text():
                return True
        except OSError:
            pass
    return False


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_all(mnt: Path, sha: dict[str, str], errors: list, wrong: list) -> None:
    def one(rel: str) -> None:
        try:
            got = hashlib.sha256((mnt / rel).read_bytes()).hexdigest()
        except OSError as exc:
            errors.append((rel, exc.errno))
            return
        if got != sha[rel]:
            wrong.append(rel)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, sorted(sha)))


def _round(mnt: Path, sha: dict[str, str], probe: Path, kill: bool) -> tuple[float, int, int]:
    holder = _stats(mnt)["holder_pid"]
    deadline = time.monotonic() + 120
    while not _spare_standing_by(holder):
        if time.monotonic() > deadline:
            raise SystemExit("the spare daemon never stood by")
        time.sleep(0.05)
    for rel in sha:
        drop_pages(mnt / rel)
    errors: list = []
    wrong: list = []
    readers = threading.Thread(target=_read_all, args=(mnt, sha, errors, wrong))
    readers.start()
    time.sleep(0.2)
    before = _stats(mnt)
    old = [before["pid"], *before["workers"]]
    drop_pages(probe)
    began = time.monotonic()
    if kill:
        os.kill(before["pid"], signal.SIGKILL)
        # The probe must not be answered by what is left of the old daemon (its workers live
        # a few milliseconds longer): read once every old process is gone.
        while any(_alive(pid) for pid in old):
            time.sleep(0.001)
    probe.read_bytes()
    gap = time.monotonic() - began
    readers.join()
    return gap, len(errors), len(wrong)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--workers", default="1")
    p.add_argument("--files", type=int, default=400)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardfs-takeover-"))
    mnt = work / "mnt"
    mnt.mkdir()
    try:
        shard_dir, sha, nshards = _make_data(work / "data", args.files, 25)
        pattern = f"file://{shard_dir}/train-{{000000..{nshards - 1:06d}}}.tar"
        subprocess.run([sys.executable, "-m", "shardfs", "mount", pattern, str(mnt),
                        "--cache-dir", str(work / "cache"), "--no-warm", "--in-place", "off",
                        "--log-level",
                        os.environ.get("SHARDFS_BENCH_LOG_LEVEL", "info"), "--workers",
                        args.workers], check=True, stdout=subprocess.DEVNULL,
                       # every kill counts as a death: keep the give-up rule out of the way
                       env={**os.environ, "SHARDFS_HOLDER_GIVE_UP": "1000/60"})
        probe = mnt / sorted(sha)[-1]
        gaps, base = [], []
        errors = wrong = 0
        for i in range(args.kills):
            b, e1, w1 = _round(mnt, sha, probe, kill=False)
            g, e2, w2 = _round(mnt, sha, probe, kill=True)
            base.append(b)
            gaps.append(g)
            errors += e1 + e2
            wrong += w1 + w2
            print(f"kill {i + 1}: gap {g:.3f} s (probe read without a kill: {b:.3f} s)",
                  flush=True)
        s = _stats(mnt)
        print(f"--workers {args.workers}, {args.files} files, {args.kills} kills: median gap "
              f"{statistics.median(gaps):.3f} s (min {min(gaps):.3f}, max {max(gaps):.3f}); "
              f"median probe read without a kill {statistics.median(base):.3f} s; "
              f"takeovers {s['takeovers']}; read errors {errors}; wrong files {wrong}")
    finally:
        subprocess.run([sys.executable, "-m", "shardfs", "umount", str(mnt)],
                       stderr=subprocess.DEVNULL)
        time.sleep(1)
        if not os.environ.get("KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(work)


if __name__ == "__main__":
    main()
