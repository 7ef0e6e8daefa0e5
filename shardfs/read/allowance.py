"""The duplicate allowance, and the cold start's clock it depends on.

A member read of a shard that a whole-shard download also brings (the download is queued for
a slot, or its frontier is far behind the read) fetches those bytes twice. That buys an
earlier answer to one read, and costs the link the member's bytes: worth it for a training
job's first batches, not for the rest of an epoch that will have every shard anyway. So such
reads draw on an allowance (the reader's policy, `ReadPolicy` in reader.py, says why each
number is what it is):

- up to `early_fraction` (10 %) of the bytes of whole-shard downloads started or queued;
- once the cold start is over (see `ColdStart`), what was left of that lapses: the allowance
  grows only by `late_fraction` (3 %) of the bytes started or queued since;
- but a read that has waited `late_patience_s` may still take its member within the early
  fraction (a worker whose first batch outlasts the cold start must not wait a whole
  download's turn per read);
- and a read whose member its shard's download will take instead of fetching it again (the
  shard is still queued: download.py, `Downloads._reuse_member_reads`) costs the link nothing
  twice as long as the member stays in the member cache: the early fraction holds for it
  throughout, so the bytes fetched stay within it even where the cache turns over first.

With no cold start (0 seconds) the early fraction holds throughout.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardfs.read.reader import ReaderStats


class ColdStart:
    """The cold start's clock: from the first read that finds its shard not cached, for
    `seconds` (0: no cold start). While it runs, the reader lets fewer downloads share the
    link with the first reads' member GETs (reader.py, `ReadPolicy.cold_start_fetches`)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.since: float | None = None  # when it began (time.monotonic())

    @property
    def begun(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        self.since = time.monotonic()

    def running(self) -> bool:
        return (self.since is not None and self.seconds > 0
                and time.monotonic() - self.since < self.seconds)

    def over(self) -> bool:
        """A cold start ran and has ended (False: none yet, or none at all)."""
        return self.since is not None and self.seconds > 0 and not self.running()


class DuplicateAllowance:
    """The bytes member reads may fetch twice (see the module's docstring). Spending is
    counted in the reader's stats (`early_member_reads`, `early_member_bytes`)."""

    def __init__(self, stats: ReaderStats, cold_start: ColdStart, *, early_fraction: float,
                 late_fraction: float, late_patience_s: float) -> None:
        self.stats = stats
        self.cold_start = cold_start
        self.early_fraction = early_fraction
        self.late_fraction = late_fraction
        self.late_patience_s = late_patience_s
        # The spend and the bytes started when the cold start ended: taken at the first
        # look after its end, before any spend after it.
        self._at_end: tuple[int, int] | None = None

    def allows(self, nbytes: int, started: int, waited: float = 0.0, *,
               taken_later: bool = False) -> bool:
        """May a read that has waited `waited` seconds fetch `nbytes` twice now? `started`:
        the bytes of whole-shard downloads started or queued so far; `taken_later`: its
        shard's download will take the member rather than fetch it again."""
        allowance = self.early_fraction * started
        spent = self.stats.early_member_bytes
        if self.cold_start.over() and not taken_later:
            if self._at_end is None:  # the first look since it ended: no spend yet
                self._at_end = (spent, started)
            if waited < self.late_patience_s:
                spent_then, started_then = self._at_end
                allowance = min(allowance,
                                spent_then + self.late_fraction * (started - started_then))
        return spent + nbytes <= allowance

    def spend(self, nbytes: int) -> None:
        self.stats.early_member_reads += 1
        self.stats.early_member_bytes += nbytes

    def late_wait(self, waited: float) -> float:
        """How much longer a read that has waited `waited` seconds should wait before it may
        look again under the early fraction: 0 when it may now, or when no cold start has
        ended (then the early fraction holds anyway)."""
        if not self.cold_start.over():
            return 0.0
        return max(0.0, self.late_patience_s - waited)
