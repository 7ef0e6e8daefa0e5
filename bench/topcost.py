"""What `shardfs top` costs the readers it watches.

`python -m bench.topcost [--files 4000] [--rounds 3] [--seconds 3]`: packs a small ImageFolder
into local shards, mounts it, reads every file once (page cache warm), then reads epochs of
page-cache hits for `--seconds` at a time, in turns without `top` and with `shardfs top --json`
watching the mount (its inotify watch gets an event per file closed, and stats each file).
Prints files/s of each turn, their ratio, and top's own CPU. Run it under
`flock /tmp/shardfs-bench.lock`.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardfs.devtools.datagen import make_imagefolder
from shardfs.pack import pack
from shardfs.util.proc import cpu_seconds

SHARDFS = [sys.executable, "-m", "shardfs"]


def epochs(files: list[str], seconds: float) -> float:
    """Files/s of whole-file reads in random order for `seconds`."""
    done = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        random.shuffle(files)
        for path in files:
            with open(path, "rb") as f:
                f.read()
            done += 1
    return done / (time.monotonic() - start)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.topcost", description=__doc__)
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardfs-topcost-") as tmp:
        base = Path(tmp)
        make_imagefolder(base / "tree", classes=20, per_class=args.files // 20, mean_kb=8,
                         seed=1)
        result = pack(base / "tree", base / "shards", prefix="train", shard_size=1 << 20)
        mnt = base / "mnt"
        mnt.mkdir()
        last = len(result.shards) - 1
        subprocess.run([*SHARDFS, "mount", f"{base}/shards/train-{{000000..{last:06d}}}.tar",
                        str(mnt), "--cache-dir", str(base / "cache")], check=True,
                       capture_output=True)
        try:
            files = [os.path.join(d, f) for d, _, fs in os.walk(mnt) for f in fs]
            epochs(files, 0.1)  # once through: every file in the page cache
            for path in files:
                Path(path).read_bytes()
            without, with_top, top_cpu = [], [], []
            for _ in range(args.rounds):
                without.append(epochs(files, args.seconds))
                top = subprocess.Popen([*SHARDFS, "top", "--json", str(mnt)],
                                       stdout=subprocess.DEVNULL)
                time.sleep(1.5)  # its start-up and directory walk, outside the timing
                cpu0 = cpu_seconds(top.pid) or 0.0
                with_top.append(epochs(files, args.seconds))
                top_cpu.append(((cpu_seconds(top.pid) or 0.0) - cpu0) / args.seconds)
                top.terminate()
                top.wait()
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
    print(f"{len(files)} files of ~8 KiB, page-cache re-reads, 1 reader, {args.rounds} turns "
          f"of {args.seconds:g} s each")
    for i, (a, b, c) in enumerate(zip(without, with_top, top_cpu, strict=True)):
        print(f"turn {i + 1}: without top {a:,.0f} files/s, with top {b:,.0f} files/s "
              f"(x{b / a:.2f}), top's CPU {100 * c:.0f}% of a core")
    print(f"median ratio with/without: "
          f"{sorted(b / a for a, b in zip(without, with_top, strict=True))[args.rounds // 2]:.2f}")


if __name__ == "__main__":
    main()
