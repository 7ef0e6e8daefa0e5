"""The working set over streams of reads (shardfs/read/workingset.py): batches of reads noted
late must not make uniformly random reads look local, and a stream that stops reading must not
keep its shards in the working set."""

from __future__ import annotations

import random

from shardfs.read.workingset import WorkingSet

SHARDS = 10
SIZE = 1000


def shards_in(ws: WorkingSet) -> list[int]:
    return [s for s in range(SHARDS) if s in ws]


def test_one_stream_is_a_window_of_the_last_reads():
    ws = WorkingSet([SIZE] * SHARDS, window=4)
    for shard in (0, 1, 2, 3, 4, 5):
        ws.touch(shard)
    assert shards_in(ws) == [2, 3, 4, 5]
    assert ws.nbytes == 4 * SIZE


def test_a_late_batch_does_not_push_the_other_reads_out():
    """Uniformly random reads: most are hits on the 5 cached shards, answered in C and noted
    in batches of 200; the others are misses answered here. One window over both would hold
    only the batch's 5 shards (the bug: whole-shard fetches started, the cache thrashed)."""
    rng = random.Random(1)
    ws = WorkingSet([SIZE] * SHARDS, window=140)
    for _ in range(50):
        for _ in range(30):
            ws.touch(rng.randrange(5, 10))  # misses, uncached shards
        ws.note("c", [rng.randrange(0, 5) for _ in range(200)])
        # More than the 5 cached shards (the budget): member reads, not whole shards. The
        # misses' window is their share of it (~18 reads), which may miss one of them.
        assert ws.nbytes >= 8 * SIZE


def test_a_stream_that_stops_leaves_the_working_set():
    ws = WorkingSet([SIZE] * SHARDS, window=50)
    ws.note(("worker", 1), [7] * 50)
    for _ in range(500):  # its share halves every 50 reads
        ws.touch(2)
    assert shards_in(ws) == [2]
    assert ws.nbytes == SIZE


def test_streams_of_a_locality_reader_share_one_window():
    """A shard-by-shard reader whose reads land in three streams (the daemon's misses, its C
    reads, a worker's notes): the union of their windows spans what one window would, the last
    `window` reads. (Shares updated by the clock, every 0.25 s, left each stream a whole window
    in a short run, so a 5-shard budget stopped paying for a reader in 3-4 shards.)"""
    ws = WorkingSet([SIZE] * SHARDS, window=32)
    for shard in range(SHARDS):  # 12 reads each, spread over three streams
        for i in range(12):
            ws.note(("here", "c", ("worker", 1))[i % 3], [shard])
    assert shards_in(ws) in ([7, 8, 9], [6, 7, 8, 9])


def test_a_stream_holds_its_share_of_the_window():
    """A locality reader served 90 % in C: its window is most of the window, and the few
    reads answered here (a shard read long ago) do not linger as a whole window would."""
    ws = WorkingSet([SIZE] * SHARDS, window=100)
    ws.touch(9)  # long ago
    for shard in range(5):
        ws.note("c", [shard] * 90)
        for _ in range(10):
            ws.touch(shard)
    assert shards_in(ws) == [4]  # the last 100 reads: 90 in C, 10 here


def last(reads: list[int], n: int) -> list[int]:
    return reads[max(0, len(reads) - n):]


class _ReadByRead:
    """The working set as its docstring defines it, one read at a time: each stream's last
    `limit` reads, the union of their shards; shares updated after a batch fills a period."""

    def __init__(self, sizes: list[int], window: int) -> None:
        self.sizes, self.window = sizes, window
        self.streams: dict[object, dict] = {}
        self.period = 0

    def note(self, stream: object, shards: list[int]) -> None:
        got = self.streams.setdefault(stream, {"recent": [], "limit": self.window,
                                               "reads": 0, "share": -1.0})
        for shard in shards:
            got["recent"].append(shard)
            got["reads"] += 1
            self.period += 1
        got["recent"] = last(got["recent"], got["limit"])
        if self.period >= self.window:
            total, self.period = self.period, 0
            for name, s in list(self.streams.items()):
                now = s["reads"] / total
                s["share"] = now if s["share"] < 0 else 0.5 * (s["share"] + now)
                s["reads"] = 0
                s["limit"] = round(self.window * s["share"])
                s["recent"] = last(s["recent"], s["limit"])
                if s["limit"] == 0:
                    del self.streams[name]

    def shards(self) -> set[int]:
        return {shard for s in self.streams.values() for shard in s["recent"]}


def test_batches_as_runs_match_the_window_read_by_read():
    """The window keeps runs of one shard's reads (a batch of C reads comes shard by shard);
    what it holds must be what a window of single reads holds, after every batch: runs cut
    by a trim, runs continued by the next batch, streams that come and go."""
    rng = random.Random(7)
    sizes = [100 + 7 * s for s in range(SHARDS)]
    for window in (1, 5, 32, 140):
        ws, model = WorkingSet(sizes, window), _ReadByRead(sizes, window)
        for _ in range(400):
            stream = rng.choice(("here", "c", ("worker", 1), ("worker", 2)))
            if stream == "here":
                batch = [rng.randrange(SHARDS)]
            else:
                batch = []
                for _ in range(rng.randrange(0, 6)):
                    batch += [rng.randrange(SHARDS)] * rng.randrange(1, 3 * window)
            ws.note(stream, batch)
            model.note(stream, batch)
            assert set(shards_in(ws)) == model.shards()
            assert ws.nbytes == sum(sizes[s] for s in model.shards())
