"""The working set over streams of reads (shardfs/read/workingset.py): batches of reads noted
late must not make uniformly random reads look local, and a stream that stops reading must not
keep its shards in the working set."""

from __future__ import annotations

import random

import pytest

from shardfs.read import workingset
from shardfs.read.workingset import WorkingSet

SHARDS = 10
SIZE = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def next_period(self) -> None:
        self.now += workingset.PERIOD_S


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_one_stream_is_a_window_of_the_last_reads(clock: Clock):
    ws = WorkingSet([SIZE] * SHARDS, window=4, clock=clock)
    for shard in (0, 1, 2, 3, 4, 5):
        ws.touch(shard)
    assert [s for s in range(SHARDS) if s in ws] == [2, 3, 4, 5]
    assert ws.nbytes == 4 * SIZE


def test_a_late_batch_does_not_push_the_other_reads_out(clock: Clock):
    """Uniformly random reads: half are hits on the 5 cached shards, answered in C and noted
    in batches of 200; the others are misses answered here. One window over both would hold
    only the batch's 5 shards (the bug: whole-shard fetches started, the cache thrashed)."""
    rng = random.Random(1)
    ws = WorkingSet([SIZE] * SHARDS, window=140, clock=clock)
    for _ in range(20):  # periods
        for _ in range(4):  # batches per period
            for _ in range(30):
                ws.touch(rng.randrange(5, 10))  # misses, uncached shards
            ws.note("c", [rng.randrange(0, 5) for _ in range(200)])
            # More than the 5 cached shards (the budget): member reads, not whole shards. The
            # misses' window is their share of it (~18 reads), which may miss one of them.
            assert ws.nbytes >= 8 * SIZE
        clock.next_period()


def test_a_stream_that_stops_leaves_the_working_set(clock: Clock):
    ws = WorkingSet([SIZE] * SHARDS, window=50, clock=clock)
    ws.note(("worker", 1), [7] * 50)
    for _ in range(12):
        for _ in range(10):
            ws.touch(2)
        clock.next_period()
    assert 2 in ws and 7 not in ws
    assert ws.nbytes == SIZE


def test_a_stream_holds_its_share_of_the_window(clock: Clock):
    """A locality reader served 90 % in C: its window is most of the window, and the few
    reads answered here (a shard read long ago) do not linger as a whole window would."""
    ws = WorkingSet([SIZE] * SHARDS, window=100, clock=clock)
    ws.touch(9)  # long ago
    for shard in range(5):
        clock.next_period()
        ws.note("c", [shard] * 90)
        for _ in range(10):
            ws.touch(shard)
    assert 9 not in ws
    assert [s for s in range(SHARDS) if s in ws] == [3, 4]
