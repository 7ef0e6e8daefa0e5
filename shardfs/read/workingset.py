"""The working set: the distinct shards touched by the most recent `window` reads, and their
bytes.

Reads reach the reader in several *streams*: the reads it answers itself, one at a time as
they happen, and batches noted later — the reads the shim answered in C in this process, and
each FUSE worker's reads of cache files. A batch covers 10-40 ms of reads and arrives all at
once, so the true interleaving of the streams is lost. Appended to one window, a batch of a
few hundred reads of the cached shards would push every other read out of it, and uniformly
random reads would look local (the cached shards only), starting whole-shard fetches that
thrash the cache.

So each stream keeps its own window, as long as its share of the recent reads makes it: a
stream that served 80 % of the reads of the last periods (a period: `window` reads of all
streams) holds its last 0.8 x `window` reads. The working set is the union of the windows,
which is what one window over the interleaved reads would hold. A stream that stops reading
(a worker that left) shrinks to nothing within a few periods.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from itertools import groupby

HERE = "here"  # the stream of reads the reader answers itself


def runs_of(shards: Iterable[int]) -> list[tuple[int, int]]:
    """Reads as (shard, how many in a row): a batch of C reads comes shard by shard."""
    return [(shard, len(list(run))) for shard, run in groupby(shards)]


class _Stream:
    __slots__ = ("length", "limit", "reads", "recent", "share")

    def __init__(self, limit: int) -> None:
        # The window's reads as runs of reads of one shard, oldest first: a batch of C reads
        # comes shard by shard (hundreds of reads, a few shards), so the work per batch goes
        # with its shards, not its reads (~1.1 us a read on the daemon's loop otherwise).
        self.recent: deque[list[int]] = deque()  # [shard, reads]
        self.length = 0  # reads in `recent`
        self.limit = limit  # the window's length for this stream
        self.reads = 0  # reads in the current period
        self.share = -1.0  # of all reads, moving average over periods (-1: none ended yet)


class WorkingSet:
    def __init__(self, sizes: Sequence[int], window: int) -> None:
        self.sizes = sizes
        self.window = window
        self.nbytes = 0  # bytes of the distinct shards in any stream's window
        self._count: dict[int, int] = {}  # shard -> its reads in all windows (> 0)
        self._streams: dict[Hashable, _Stream] = {}
        self._period_reads = 0  # reads of all streams since the shares were last updated

    def __contains__(self, shard: int) -> bool:
        return shard in self._count

    def touch(self, shard: int) -> None:
        """One read answered here, now."""
        self.note(HERE, (shard,))

    def note(self, stream: Hashable, shards: Iterable[int]) -> None:
        """Reads of `stream`, in the order they were served."""
        self.note_runs(stream, runs_of(shards))

    def note_runs(self, stream: Hashable, runs: Iterable[tuple[int, int]]) -> None:
        """Reads of `stream` as (shard, reads in a row), in the order they were served."""
        got = self._streams.get(stream)
        if got is None:  # a whole window until its share is known (at most `window` reads)
            got = self._streams[stream] = _Stream(self.window)
        before = got.reads
        for shard, reads in runs:
            self._add(got, shard, reads)
        self._trim(got)
        self._period_reads += got.reads - before
        if self._period_reads >= self.window:
            self._new_period()

    def _add(self, stream: _Stream, shard: int, reads: int) -> None:
        stream.reads += reads
        stream.length += reads
        recent = stream.recent
        if recent and recent[-1][0] == shard:
            recent[-1][1] += reads
        else:
            recent.append([shard, reads])
        count = self._count
        had = count.get(shard, 0)
        if had == 0:
            self.nbytes += self.sizes[shard]
        count[shard] = had + reads

    def _trim(self, stream: _Stream) -> None:
        """Drop the stream's oldest reads past its limit."""
        excess = stream.length - stream.limit
        recent, count = stream.recent, self._count
        while excess > 0:
            run = recent[0]
            shard, reads = run
            if reads > excess:  # part of the oldest run stays
                run[1] -= excess
                dropped = excess
            else:
                recent.popleft()
                dropped = reads
            excess -= dropped
            stream.length -= dropped
            left = count[shard] - dropped
            if left:
                count[shard] = left
            else:
                del count[shard]
                self.nbytes -= self.sizes[shard]

    def _new_period(self) -> None:
        total, self._period_reads = self._period_reads, 0
        for name, stream in list(self._streams.items()):
            now_share = stream.reads / total
            stream.share = now_share if stream.share < 0 else 0.5 * (stream.share + now_share)
            stream.reads = 0
            stream.limit = round(self.window * stream.share)
            self._trim(stream)
            if stream.limit == 0:
                del self._streams[name]
