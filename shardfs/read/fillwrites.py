"""How one `Lookahead` fill's GETs write the shard's part file, and what they tell its check.

- Bytes a GET also lands in the shared arena (the fill's member GETs) go to the part file
  with O_DIRECT where the cache's file system allows (cache/directwrite.py): gathered in a
  reused aligned buffer, written in a worker thread, counted as written only then. Other
  GETs of the fill (its holes, a read's urgent member) write through the page cache as
  before: a read may be waiting on their bytes in the part file.
- Each GET's bytes are one run of the shard; with the run's CRC-32C kept, the whole shard's
  CRC-32C (what the index's check compares) is combined from the runs at commit
  (`crc32c_of_runs`), with no second pass over the part file, whose pages direct writes
  left on the disk.
"""

from __future__ import annotations

import contextlib
import os

from shardfs.cache.directwrite import DirectWrites
from shardfs.cache.shardcache import PartFile
from shardfs.util.checksum import KnownDigest, crc32c_of_runs


class FillWrites:
    __slots__ = ("direct_bytes", "direct_fd", "runs")

    def __init__(self, part: PartFile, direct: DirectWrites | None, crcs: bool) -> None:
        self.direct_fd = direct.open(part.path) if direct is not None else None
        self.direct_bytes = 0  # bytes written with O_DIRECT
        # [start, end, CRC-32C] of each GET's bytes, when the shard is checked by CRC-32C
        self.runs: list[list[int]] | None = [] if crcs else None

    @property
    def direct(self) -> bool:
        """Some of the fill's bytes bypassed the page cache: its pages are not there."""
        return self.direct_bytes > 0

    def run(self, start: int) -> list[int] | None:
        """The [start, end, CRC-32C] of the bytes a GET from `start` has received so far,
        kept up to date by the GET as each chunk comes (before its bytes count as written,
        so the fill's last bytes are never checked without their CRC); None when the
        shard's check is not a CRC-32C."""
        if self.runs is None:
            return None
        run = [start, start, 0]
        self.runs.append(run)
        return run

    def digest(self, size: int) -> KnownDigest | None:
        """The shard's CRC-32C from its runs; None when they do not tile it (GETs that
        overlapped, or CRCs not kept): read it back from the part file then."""
        if self.runs is None:
            return None
        crc = crc32c_of_runs([(a, b, c) for a, b, c in self.runs if b > a], size)
        return None if crc is None else KnownDigest(f"{crc:08x}")

    def close(self) -> None:
        if self.direct_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.direct_fd)
            self.direct_fd = None
