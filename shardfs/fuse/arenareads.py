"""Reads of the lookahead arena's members answered in C, in a FUSE worker process.

With the shim's reads in C in effect (fastread.py), a worker hands what the daemon tells it
about the shared arena (shardfs/read/arena.py: where each announced member landed, which
left) to the shim's table too (`_shim_arena.c`), and the shim answers a READ of such a member
itself: a table lookup and a copy out of its own mapping, the generation checked before and
after as `ArenaView.copy` does. Served by pyfuse3's loop, each such read cost the worker a
few hundred microseconds of Python on 2 cores (docs/benchmarks-notes.md, "Arena reads in C").

The shim records each read it served in `taken` (shard, member offset, arena offset, bytes);
`collect` empties it, and the worker reports those reads as its own arena reads (the daemon
frees members once read and fetches on). When `taken` is full, reads go to Python, which asks
the daemon for them, until the next collection. The shim's reader thread (docs/pyfuse3.md)
answers such reads too, without the GIL: the table and `taken` change here only under
`shim.paused()`, but for landings, which the shim queues under a lock of its own and moves
into the table at its next lookup (a landing need not wait for a READ being answered).
"""

from __future__ import annotations

import os
from array import array

from shardfs.fuse import shim

# Reads the shim records between two collections (every 10-40 ms); past it, Python answers.
TAKEN_RECORDS = 4096


def in_c_wanted(c_reads_active: bool) -> bool:
    """Whether a serving process whose shim answers reads in C (`FastReads.active`) should
    answer the arena's too: unless SHARDFS_ARENA_IN_PYTHON=1 keeps them in Python (to
    measure one against the other)."""
    return c_reads_active and not os.environ.get("SHARDFS_ARENA_IN_PYTHON")


class ArenaReads:
    def __init__(self, path: str, total: int, size: int) -> None:
        """Have the shim map the arena (raises OSError if it cannot be opened or mapped)."""
        self.taken = array("Q", bytes(8 * 4 * TAKEN_RECORDS))
        self.taken_len = array("Q", [0])
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with shim.paused():
                res = shim.arena_map(fd, total, size, self.taken, self.taken_len)
        finally:
            os.close(fd)
        if res != 0:
            raise OSError(-res, f"the shim cannot map the lookahead arena {path}")

    @staticmethod
    def landed(entries: list[tuple[int, int, int, int]]) -> None:
        """(shard, member offset, arena offset, generation) of members that landed: queued
        for the shim's table without waiting for a READ it is answering."""
        if entries:
            shim.arena_landed(_flat(entries))

    @staticmethod
    def gone(entries: list[tuple[int, int, int, int]]) -> None:
        """The same for members that left the arena (their places may be reused at once:
        no READ may be copying them meanwhile)."""
        if entries:
            flat = _flat(entries)
            with shim.paused():
                shim.arena_gone(flat)

    def collect(self) -> list[tuple[int, int, int, int]]:
        """The reads the shim served since the last call: (shard, member offset, arena
        offset, bytes) each."""
        if self.taken_len[0] == 0:
            return []
        with shim.paused():
            n = self.taken_len[0]
            flat = self.taken[: 4 * n]
            self.taken_len[0] = 0
        return list(zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True))


def _flat(entries: list[tuple[int, int, int, int]]) -> array:
    return array("Q", [n for entry in entries for n in entry])
