"""One whole-shard download in progress: which of its bytes are on disk, and who waits.

A fetch starts as one GET of the whole shard, written in order into the shard's `.part` file.
A read of a member far ahead of that GET may *split* it (Reader._split): the GET stops where
the member begins, the member comes by a GET of its own, and a third GET brings what followed
the member. So the bytes arrive in runs, not as one frontier: `has(start, end)` says whether a
range is on disk. `arrived` stays the contiguous prefix [0, arrived): that is all the FUSE
workers and the shim's C reads are told (read/states.py), so they serve nothing else; reads
of later runs go through the reader, which knows the runs.
"""

from __future__ import annotations

import heapq
import itertools
import time

import trio

MIN_RATE_BYTES = 64 * 1024  # a GET's rate is judged only after this many bytes
NEVER = 1 << 62


class Get:
    """One GET of a fetch: bytes [pos, stop) are still to come. `stop` only moves down, when
    a read splits the GET; the GET then ends there."""

    __slots__ = ("first_byte", "pos", "start", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.start = self.pos = start
        self.stop = stop
        self.first_byte: float | None = None  # monotonic time of its first chunk

    @property
    def running(self) -> bool:
        return self.pos < self.stop

    def rate(self, now: float) -> float | None:
        """Bytes/s since its first byte (None: too few bytes yet to judge)."""
        got = self.pos - self.start
        if self.first_byte is None or got < MIN_RATE_BYTES or now <= self.first_byte:
            return None
        return got / (now - self.first_byte)

    def eta(self, end: int, now: float) -> float | None:
        """Seconds until this GET passes `end` at its measured rate (None: no rate yet)."""
        rate = self.rate(now)
        return None if rate is None else max(0, end - self.pos) / rate


class Fetch:
    """A whole-shard download: its GETs, the runs of bytes on disk, the reads waiting."""

    def __init__(self, shard: int, part, size: int) -> None:  # part: cache.PartFile
        self.shard = shard
        self.part = part
        self.size = size
        self.arrived = 0  # bytes [0, arrived) are on disk
        self.began = time.monotonic()
        self.first_byte: float | None = None  # monotonic time of the first chunk
        self.failed: BaseException | None = None  # set once readers must stop waiting
        self.error: BaseException | None = None  # the first GET's failure: ends the fetch
        self.gets: list[Get] = [Get(0, size)]
        self.split = False  # more than the one GET: bytes arrived out of order
        # Filled by the Lookahead's member GETs (no whole-shard GET; Reader.open_fill): its
        # GETs come and go, and it completes when every byte is in.
        self.fill = False
        self.writes = None  # a fill's: how its GETs write the part file (read/fillwrites.py)
        self.nursery: trio.Nursery | None = None  # runs the GETs a split adds
        # Once `arrived` reaches this, the next blocks of the prefix are recorded in the part's
        # record (Downloads.record_blocks); NEVER: no record, or recording under way.
        self.record_due = NEVER
        self._runs: list[list[int]] = []  # [start, end) on disk, sorted, apart
        # (end, seq, start, event), a heap by end: while the bytes come as one frontier, a
        # chunk wakes exactly the waiters it reaches and looks at no other.
        self._waiters: list[tuple[int, int, int, trio.Event]] = []
        self._seq = itertools.count()

    # -- what is on disk -------------------------------------------------------------------
    def has(self, start: int, end: int) -> bool:
        if end <= self.arrived:
            return True
        for run_start, run_end in self._runs:
            if run_start <= start:
                if end <= run_end:
                    return True
            else:
                return False
        return False

    def filled(self, start: int, n: int) -> None:
        """Bytes [start, start+n) are written to the part file."""
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        end = start + n
        runs = self._runs
        for i, run in enumerate(runs):  # most often: a GET extends the run it writes
            if run[1] == start:
                run[1] = end
                if i + 1 < len(runs) and runs[i + 1][0] <= end:  # it reached the next run
                    run[1] = max(end, runs[i + 1][1])
                    del runs[i + 1]
                break
        else:
            runs.append([start, end])
            runs.sort()
            merged = [runs[0]]
            for run in runs[1:]:
                if run[0] <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], run[1])
                else:
                    merged.append(run)
            self._runs = runs = merged
        if runs[0][0] == 0:
            self.arrived = runs[0][1]
        waiters = self._waiters
        if not waiters:
            return
        if not self.split:  # one run from 0: a waiter is served iff its end has arrived
            arrived = self.arrived
            while waiters and waiters[0][0] <= arrived:
                heapq.heappop(waiters)[3].set()
            return
        still = []
        for waiter in waiters:
            if self.has(waiter[2], waiter[0]):
                waiter[3].set()
            else:
                still.append(waiter)
        heapq.heapify(still)
        self._waiters = still

    # -- waiting -----------------------------------------------------------------------------
    def covering(self, pos: int) -> Get | None:
        """The running GET that will bring byte `pos`, if any."""
        for get in self.gets:
            if get.pos <= pos < get.stop:
                return get
        return None

    def coming(self, start: int, end: int) -> bool:
        """Every byte of [start, end) is on disk or on its way by a running GET."""
        return not self.missing(start, end)

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of [start, end) neither on disk nor on their way, in order."""
        spans = sorted([(a, b) for a, b in self._runs if b > start and a < end]
                       + [(g.pos, g.stop) for g in self.gets if g.running and g.stop > start
                          and g.pos < end])
        holes: list[tuple[int, int]] = []
        pos = start
        for a, b in spans:
            if a > pos:
                holes.append((pos, min(a, end)))
            pos = max(pos, b)
            if pos >= end:
                break
        if pos < end:
            holes.append((pos, end))
        return holes

    def to_go(self, pos: int) -> int:
        """Bytes the GET bringing byte `pos` has still to bring before it (0: none)."""
        get = self.covering(pos)
        return 0 if get is None else pos - get.pos

    def eta(self, start: int, end: int) -> float | None:
        """Seconds until bytes [start, end) are in, at the rate of the GET bringing them
        (None: no rate yet, or no GET brings them)."""
        if self.has(start, end):
            return 0.0
        get = self.covering(end - 1)
        return None if get is None else get.eta(end, time.monotonic())

    @property
    def ttfb(self) -> float | None:
        return None if self.first_byte is None else self.first_byte - self.began

    async def wait_for(self, start: int, end: int) -> None:
        if not self.has(start, end) and self.failed is None:
            event = trio.Event()
            heapq.heappush(self._waiters, (end, next(self._seq), start, event))
            await event.wait()
        if not self.has(start, end):
            raise FetchFailed(self.failed)

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        for *_, event in self._waiters:
            event.set()
        self._waiters.clear()


class FetchFailed(Exception):
    def __init__(self, cause: BaseException | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
