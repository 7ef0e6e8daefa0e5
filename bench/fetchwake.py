"""CPU that `Fetch.filled` spends per chunk waking the reads that wait on a download.

`python -m bench.fetchwake [--waiters 0,8,64] [--rounds 5]`: a 12 MiB fetch fed in 64 KiB
chunks, in order (one frontier), with N reads waiting on random 100 KB ranges; prints the
best of the rounds in microseconds per chunk. No mount, no network.
"""

from __future__ import annotations

import argparse
import random
import time

import trio

from shardfs.read.fetch import Fetch

SIZE, CHUNK = 12 << 20, 64 << 10


async def _feed(waiters: int) -> float:
    fetch = Fetch(0, None, SIZE)
    rng = random.Random(1)
    async with trio.open_nursery() as nursery:
        for _ in range(waiters):
            start = rng.randrange(SIZE - 200_000)
            nursery.start_soon(fetch.wait_for, start, start + 100_000)
        await trio.sleep(0.01)  # every waiter registered
        began = time.perf_counter()
        for at in range(0, SIZE, CHUNK):
            fetch.filled(at, CHUNK)
        took = time.perf_counter() - began
        nursery.cancel_scope.cancel()
    return took / (SIZE // CHUNK)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fetchwake", description=__doc__)
    p.add_argument("--waiters", default="0,8,64", help="reads waiting, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    for n in (int(w) for w in args.waiters.split(",")):
        best = min(trio.run(_feed, n) for _ in range(args.rounds))
        print(f"{n:3d} reads waiting: {best * 1e6:.2f} us per 64 KiB chunk", flush=True)


if __name__ == "__main__":
    main()
