"""Read every file under a directory with N threads and print files/s (warm-read probe).

    python -m bench.readall /mnt/x/train 4
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def main(root: str, threads: int) -> None:
    files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(_read, files))
    took = time.monotonic() - began
    print(f"{len(files)} files, {total / 1e6:.1f} MB in {took:.2f} s: {len(files) / took:.0f} "
          f"files/s, {total / took / 1e6:.0f} MB/s ({threads} threads)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
