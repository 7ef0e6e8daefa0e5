"""The shim's table of arena members (shardfs/fuse/_shim_arena.c), in this process.

A FUSE worker's shim answers READs of members the lookahead holds in its shared arena
(tests/test_lookahead.py checks that on real mounts, byte for byte). Here the table itself:
members land and leave in a random churn, the table grows past its first size and removes
from the middle of probe runs, and after every step a lookup finds exactly the members a
dict says are there, with their bytes; a member freed in the arena is never served, even
while the table still lists it; every served read is recorded for the daemon.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from shardfs.fuse import shim  # loads the shim before pyfuse3
from shardfs.fuse.arenareads import ArenaReads
from shardfs.read.arena import BLOCK, Arena

pytestmark = pytest.mark.skipif(not shim.loaded(), reason=f"shim not loaded: {shim.load_error}")


@contextmanager
def mapped(blocks: int) -> Iterator[tuple[Arena, ArenaReads]]:
    """An arena of `blocks` blocks, mapped by the shim of this process."""
    arena = Arena(blocks * BLOCK)
    try:
        yield arena, ArenaReads(arena.path, arena.total, arena.size)
    finally:
        arena.close()


def test_table_finds_what_landed_and_nothing_that_left():
    rng = random.Random(5)
    with mapped(4096) as (arena, reads):
        held: dict[tuple[int, int], tuple[int, int, int]] = {}  # -> (at, gen, size)
        late: list[tuple[int, int, int, int]] = []  # "gone" messages not delivered yet
        peak = 0
        for step in range(6000):
            if held and (rng.random() < 0.45 or arena.used > arena.size // 2):
                key = rng.choice(list(held))
                at, gen, size = held.pop(key)
                arena.free(at, size)
                # the "gone" message, or (one in ten) it comes late: the entry is stale
                if rng.random() < 0.1:
                    late.append((*key, at, gen))
                else:
                    reads.gone([(*key, at, gen)])
            else:
                # few shards, offsets from a small range: many keys share a probe run
                key = (rng.randrange(7), rng.randrange(0, 1 << 20, 512))
                if key in held:
                    continue
                size = rng.randrange(1, 3 * BLOCK)
                at = arena.alloc(size)
                assert at is not None
                arena.view[at : at + size] = os.urandom(size)
                gen = arena.gen(at)
                held[key] = (at, gen, size)
                reads.landed([(*key, at, gen)])
            if step % 50 == 0:
                reads.collect()  # keep room for the records below
                for key, (at, _, size) in held.items():
                    start = rng.randrange(size)
                    got = shim.arena_read(*key, start, size - start)
                    assert got == bytes(arena.view[at + start : at + size]), (step, key)
                for _ in range(20):  # keys that are not there (never, or no more)
                    key = (rng.randrange(7), rng.randrange(0, 1 << 20, 512))
                    if key not in held:
                        assert shim.arena_read(*key, 0, 1) is None, (step, key)
                reads.gone(late)  # late, but they come: only the members held are left
                late.clear()
                assert shim.arena_members() == len(held), step
                peak = max(peak, len(held))
        assert peak > 512  # the table grew past its first 1024 slots (half full)


def test_served_reads_are_recorded_and_freed_members_never_served():
    with mapped(64) as (arena, reads):
        at = arena.alloc(10_000)
        assert at is not None
        arena.view[at : at + 10_000] = bytes(range(256)) * 39 + bytes(16)
        gen = arena.gen(at)
        reads.landed([(3, 1536, at, gen)])
        assert shim.arena_read(3, 1536, 100, 50) == bytes(arena.view[at + 100 : at + 150])
        assert shim.arena_read(3, 1536, 9_000, 1_000) == bytes(arena.view[at + 9_000 :
                                                                          at + 10_000])
        assert reads.collect() == [(3, 1536, at, 50), (3, 1536, at, 1_000)]
        assert reads.collect() == []
        arena.free(at, 10_000)  # no "gone" told yet: the generation says it
        assert shim.arena_read(3, 1536, 0, 10) is None
        assert reads.collect() == [] and shim.arena_members() == 0
        # Reused by another member: the old location is still never served.
        again = arena.alloc(10_000)
        assert again == at
        reads.landed([(3, 1536, at, gen)])  # a landing told late, of the old generation
        assert shim.arena_read(3, 1536, 0, 10) is None
        # The same member landed again elsewhere before the old place's "gone" came: that
        # late "gone" must not make the shim forget the new place.
        other = arena.alloc(10_000)
        assert other is not None and other != at
        arena.view[other : other + 10] = b"0123456789"
        reads.landed([(3, 1536, other, arena.gen(other))])
        reads.gone([(3, 1536, at, gen)])
        assert shim.arena_read(3, 1536, 2, 3) == b"234"


def test_a_full_record_leaves_reads_to_python():
    with mapped(8) as (arena, reads):
        at = arena.alloc(100)
        assert at is not None
        reads.landed([(0, 0, at, arena.gen(at))])
        for _ in range(len(reads.taken) // 4):
            assert shim.arena_read(0, 0, 0, 1) is not None
        assert shim.arena_read(0, 0, 0, 1) is None  # no room to record it: Python's
        assert len(reads.collect()) == len(reads.taken) // 4
        assert shim.arena_read(0, 0, 0, 1) is not None


def test_a_landing_is_told_while_a_read_is_being_answered():
    """The reader thread holds the serving lock while it answers a READ; a landing must not
    wait for it (the daemon's loop did, ~0.2 s of a `Lookahead` epoch). Here the lock is held
    by the telling thread itself: a landing that needed it would never return (the child is
    killed after 20 s), and the member is found once the lock is let go."""
    with mapped(64) as (arena, reads):
        at = arena.alloc(5_000)
        assert at is not None
        arena.view[at : at + 5_000] = os.urandom(5_000)
        gen = arena.gen(at)
        want = bytes(arena.view[at : at + 5_000])
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                with shim.paused():  # as the reader thread holds it while it answers
                    reads.landed([(2, 512, at, gen)])
                code = 0 if shim.arena_read(2, 512, 0, 5_000) == want else 2
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("telling a landing waited for the serving lock")
        assert os.waitstatus_to_exitcode(done[1]) == 0
