"""Reads of complete cached shards answered in C, in the process that reads the request.

With the shim in effect (docs/pyfuse3.md), its READ wrapper answers a read itself when the
shared shard states (read/states.py) say the shard is complete on disk, this process holds a
descriptor of the cache file in `fds`, and the bytes are in the page cache; the rest comes to
`ShardFS.read` as before. This class owns what the C side reads and counts:

- `fds[shard]`: a descriptor this process opened for the complete cache file, or -1. Opened
  on the first Python read of a complete shard (`offer`), closed when the states say the
  files went away (`close_stale`). A shard's bytes never change, so a descriptor of an
  evicted (unlinked) file still reads right bytes until it is closed; it is closed within a
  collection interval so that the disk space goes.
- `counts[shard]`, `nbytes`: reads and bytes answered in C since the last `collect`, which
  hands them to whoever keeps the stats (the daemon's Reader, or a worker's notes to it).

Everything runs on the thread of the serving loop, which holds the GIL while the C wrapper
runs, so the arrays need no locks.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path

from shardfs.fuse import shim
from shardfs.read.states import COMPLETE, ShardStates

COLLECT_INTERVAL = 0.05  # seconds between collections of the C side's counts


class FastReads:
    def __init__(self, states: ShardStates, shards_dir: Path, keys: list[str]) -> None:
        n = len(keys)
        self.states = states
        self.shards_dir = shards_dir
        self.keys = keys
        self.fds = array("i", [-1]) * n
        self.counts = array("I", [0]) * n
        self.nbytes = array("Q", [0])
        self._gens: dict[int, int] = {}  # shard with a descriptor -> states.gen when opened
        self._carried: list[int] = []  # counted reads of shards closed since the collection
        self.active = shim.serve_reads(states.avail_address(), self.fds, self.counts,
                                       self.nbytes)

    def offer(self, shard: int) -> None:
        """Open the shard's cache file for C reads if it is complete and not open yet."""
        if not self.active or self.fds[shard] >= 0 or self.states.avail[shard] != COMPLETE:
            return
        gen = self.states.gen[shard]
        try:
            fd = os.open(self.shards_dir / self.keys[shard], os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # evicted meanwhile: Python reads go on as before
        if self.states.gen[shard] != gen or self.states.avail[shard] != COMPLETE:
            os.close(fd)
            return
        self._gens[shard] = gen
        self.fds[shard] = fd

    def close_stale(self) -> None:
        """Close descriptors of cache files the daemon has removed since they were opened."""
        for shard, gen in list(self._gens.items()):
            if self.states.gen[shard] != gen or self.states.avail[shard] != COMPLETE:
                fd, self.fds[shard] = self.fds[shard], -1  # C stops using it first
                del self._gens[shard]
                os.close(fd)
                self._carried += self._take(shard)

    def _take(self, shard: int) -> list[int]:
        count, self.counts[shard] = self.counts[shard], 0
        return [shard] * count

    def collect(self) -> tuple[list[int], int]:
        """The shards of the reads answered in C since the last call (one entry per read;
        empty reads at or past a file's end included), and their bytes."""
        shards, self._carried = self._carried, []
        for shard in self._gens:
            if self.counts[shard]:
                shards += self._take(shard)
        nbytes, self.nbytes[0] = self.nbytes[0], 0
        return shards, nbytes
