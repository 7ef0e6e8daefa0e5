"""Which bytes of each shard are on local disk, in memory every process of a mount shares.

The daemon's reader writes it as fetches advance, complete, fail and as shards are evicted;
FUSE worker processes read it to serve reads from the cache files without asking the daemon.
One anonymous shared mapping, created before the workers are forked, two int64 per shard:

    avail[s]  NONE (-1): nothing usable; COMPLETE (-2): `shards/KEY` is whole;
              k >= 0: bytes [0, k) are in `shards/KEY.part` (a fetch in progress)
    gen[s]    bumped whenever files of shard s go away (eviction, failed fetch), so a worker
              knows to close the descriptors it holds for them

and one int64 after them, `gone_total`: bumps of any gen, so that a process looks for
descriptors to close only when some went away (with thousands of shards open, a look over
all of them every 10 ms cost its loop ~1 ms each time).

Aligned 8-byte loads and stores are atomic on the machines we run on, and the writer stores
`avail` only after the bytes it announces were written, so a reader that sees k may read
below k.
"""

from __future__ import annotations

import ctypes
import mmap

NONE = -1
COMPLETE = -2


class ShardStates:
    def __init__(self, shards: int) -> None:
        self.shards = shards
        self._map = mmap.mmap(-1, 16 * shards + 8)  # MAP_SHARED | MAP_ANONYMOUS
        self.avail = memoryview(self._map)[: 8 * shards].cast("q")
        self.gen = memoryview(self._map)[8 * shards : 16 * shards].cast("q")
        self.gone_total = memoryview(self._map)[16 * shards : 16 * shards + 8].cast("q")
        for s in range(shards):
            self.avail[s] = NONE

    def addresses(self) -> tuple[int, int]:
        """Where `avail` and `gen` are in this process's memory (the shim's C reads check
        them)."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        return base, base + 8 * self.shards

    def arrived(self, shard: int, nbytes: int) -> None:
        self.avail[shard] = nbytes

    def complete(self, shard: int) -> None:
        self.avail[shard] = COMPLETE

    def gone(self, shard: int) -> None:
        self.avail[shard] = NONE
        self.gen[shard] += 1
        self.gone_total[0] += 1  # after gen: who sees the total moved finds the gen moved
