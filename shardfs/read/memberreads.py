"""Member reads: a member's bytes (or a block of a large member) fetched by a ranged GET of
their own, instead of waiting for their shard's whole download.

The reader (reader.py) decides *when* a read takes its member (the shard is not worth
caching whole, its download is too far behind, or the duplicate allowance lets it: see
allowance.py); this module does the fetching: one GET per member or block, shared by every
read of it that comes while it runs (a file is read in several 128 KiB READs, and only the
first fetches), the fetched blocks kept in a small LRU cache of their own, and the measured
time a member GET takes (the reader's patience on a download's frontier is two of them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from cachetools import Cache, LRUCache

from shardfs.catalog.catalog import Catalog
from shardfs.read.errors import ReadError
from shardfs.sources import SourceError, Sources

if TYPE_CHECKING:
    from shardfs.read.reader import ReaderStats

log = logging.getLogger(__name__)

Block = tuple[int, int]  # bytes [start, end) of a shard


@dataclass(slots=True)
class _PendingBlock:
    done: trio.Event = field(default_factory=trio.Event)
    data: bytes = b""
    error: str | None = "fetch did not complete"  # cleared on success


class MemberReads:
    """Ranged GETs of members and blocks, deduplicated and cached (`cache_bytes` of RAM)."""

    def __init__(self, catalog: Catalog, sources: Sources, stats: ReaderStats, *,
                 block_size: int, cache_bytes: int, max_in_flight: int) -> None:
        self.catalog = catalog
        self.sources = sources
        self.stats = stats
        self.block_size = block_size
        self._cached: LRUCache = LRUCache(maxsize=cache_bytes, getsizeof=len)
        self._in_flight: dict[tuple[int, int], _PendingBlock] = {}
        self._limiter = trio.CapacityLimiter(max_in_flight)
        self.rtt: float | None = None  # seconds per member GET, moving average

    @property
    def in_flight(self) -> int:
        """GETs running now (one per block however many reads wait on it)."""
        return len(self._in_flight)

    def block_of(self, member_off: int, member_size: int, pos: int) -> Block:
        """What a member read of byte `pos` fetches: the member, or the block of it holding
        `pos` (the unit of `read`, of the cache, and of a split of a download)."""
        block = self.block_size
        if member_size <= block:
            return member_off, member_off + member_size
        first = member_off + (pos - member_off) // block * block
        return first, min(first + block, member_off + member_size)

    def held(self, shard: int, start: int) -> bool:
        """The block at `start` is in the cache or on its way."""
        key = (shard, start)
        return key in self._cached or key in self._in_flight

    def covers(self, shard: int, member_off: int, member_size: int, start: int,
               end: int) -> bool:
        """Bytes [start, end) of the member are held (their first and last blocks)."""
        first = self.block_of(member_off, member_size, start)
        return self.held(shard, first[0]) and (end <= first[1] or self.held(
            shard, self.block_of(member_off, member_size, end - 1)[0]))

    def cached_in(self, shard: int) -> list[tuple[int, bytes]]:
        """The shard's blocks in the cache, (start, bytes), by start (for its download to
        take instead of fetching them again: Downloads._reuse_member_reads)."""
        cache = self._cached
        # Cache.__getitem__, not LRUCache's: a look at them does not make them recently used.
        return sorted((start, Cache.__getitem__(cache, (held, start)))
                      for held, start in list(cache) if held == shard)

    async def read(self, shard: int, member_off: int, member_size: int, start: int,
                   end: int) -> bytes:
        """Bytes [start, end) of a member, block by block; ReadError if a GET failed."""
        pieces = []
        pos = start
        while pos < end:
            bstart, bend = self.block_of(member_off, member_size, pos)
            data = await self._block(shard, bstart, bend)
            take = min(end, bend) - pos
            pieces.append(data[pos - bstart : pos - bstart + take])
            pos += take
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def _block(self, shard: int, start: int, end: int) -> bytes:
        key = (shard, start)
        data = self._cached.get(key)
        if data is not None:
            return data
        pending = self._in_flight.get(key)
        if pending is not None:  # someone is fetching it already: share the outcome
            await pending.done.wait()
            if pending.error is not None:
                raise ReadError(pending.error)
            return pending.data
        pending = self._in_flight[key] = _PendingBlock()
        try:
            pending.data = await self._fetch(shard, start, end)
            pending.error = None
            if len(pending.data) <= self._cached.maxsize:
                self._cached[key] = pending.data
            return pending.data
        except ReadError as exc:
            pending.error = str(exc)
            raise
        finally:
            del self._in_flight[key]
            pending.done.set()

    async def _fetch(self, shard: int, start: int, end: int) -> bytes:
        info = self.catalog.shards[shard]
        async with self._limiter:
            began = time.monotonic()
            try:
                chunks = [c async for c in self.sources.for_url(info.url).stream(info, start, end)]
            except SourceError as exc:
                self.stats.fetch_errors += 1
                self.stats.eio += 1
                log.error("reading %s [%d, %d) failed: %s", info.url, start, end, exc)
                raise ReadError(str(exc)) from None
        took = time.monotonic() - began
        self.rtt = took if self.rtt is None else 0.8 * self.rtt + 0.2 * took
        self.stats.member_fetches += 1
        self.stats.member_bytes += end - start
        return b"".join(chunks)
