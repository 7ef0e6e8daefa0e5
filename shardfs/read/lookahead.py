"""Lookahead: fetch the members a training process says it will read next, in its order.

A process that knows its future reads (`shardfs.torch.Lookahead` wraps its sampler) announces
them as an ordered list of members over a socket (see shardfs/daemon/announce.py); each
connection is one *stream*. This module keeps a bounded window of those members in flight and
in RAM so a truly random order reads at link speed instead of one member request per DataLoader
worker at a time:

- Announced members are fetched in announcement order, round robin over the streams, with up
  to `max_requests` ranged GETs in flight. A GET also takes the member's neighbours in its
  shard that the stream announced within about a buffer's worth of entries (they would be
  fetched before being read anyway), when the bytes between them are at most `coalesce_gap`
  and 1/`gap_ratio` of the member joined (the tar headers between neighbours): fewer, larger
  requests, nearly no extra bytes.
- A member is readable as soon as its own bytes of the GET are in. With FUSE worker processes
  the bytes wait in a shared arena (shardfs/read/arena.py) that the workers read themselves:
  the daemon publishes where each member landed (`landed`, `gone`) and learns which were read
  from `taken`; otherwise, and for members the arena has no room for, in daemon RAM. A
  member's place is taken when its GET starts, and each chunk is copied once, straight there
  (`_Landing`).
- Fetched bytes wait in RAM until read. Bytes held plus bytes in flight never exceed
  `buffer_bytes`: when the announced window is longer than the buffer holds, fetching pauses
  until reads consume (and so free) buffered members; it paces itself on consumption.
- A member is dropped once its bytes have all been read. A read of a member still waiting for
  its turn fetches it at once (the read needs it now).
- Stale announcements cost bytes, never correctness: bytes are only ever handed out for the
  exact member range the read asked for, and anything unread is dropped when its stream's
  reads have moved `stale_lag` entries past it, when the buffer is full while the stream's
  reads have missed `miss_limit` times in a row (its announcements do not match what it reads),
  on `reset` (a new epoch) and when the connection closes.
- Shards the reader serves without help (the shard is cached or being fetched whole,
  compressed shards) are skipped: whole-shard caching stays as it is.
- When the whole dataset fits the cache and `fill_parts` is on (`--lookahead-fill on`, the
  default; see LookaheadPolicy), the announced members' GETs fill their shards' part files
  (Reader.open_fill) instead of whole-shard GETs: each GET takes the bytes before its
  members (their tar headers: read/layout.py) with them, writes everything into the part
  file and lands the members in the arena (or RAM) as above, so FUSE workers serve the reads
  (the part file's runs are not in the states they read). The members' GETs together bring
  the whole shard but its end; that end, and whatever no announcement asked for, comes by a
  last GET once the streams have announced their epochs to the end (`last`), are reset or
  close. The reader commits a shard when every byte is in (sha256 from the part file). In
  read order, paced by the buffer, up to `fill_requests` GETs in flight, members coalesced
  when their extents join and they are announced within about a buffer's worth of entries.
  No byte is fetched twice. Otherwise (`fill_parts` off), only the first `fits_head`
  entries of each epoch are fetched here, into RAM, and the rest is left to whole shards.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import trio

from shardfs.read.arena import Arena
from shardfs.read.fetch import Fetch, Get
from shardfs.sources import ShardInfo, SourceError, Sources

log = logging.getLogger(__name__)
KiB = 1 << 10
MiB = 1 << 20

_QUEUED, _INFLIGHT, _READY, _GONE = range(4)
HOLE_SPAN = 8 * MiB  # the largest GET completing a fill (more in parallel, not one long one)
LAUNCH_BATCH = 8  # GETs launched before the loop lets them send (Lookahead._schedule)


@dataclass(slots=True)
class LookaheadPolicy:
    buffer_bytes: int = 64 * MiB  # RAM for announced members fetched (or in flight), unread
    # Ranged GETs in flight at once. 16 fill a 100 MB/s link with 20 ms latency; more cost
    # the HTTP client's connection pool more CPU per request than they gain (measured).
    max_requests: int = 16
    coalesce_gap: int = 64 * KiB  # members of one shard this close share one GET, when the
    # gap is also at most 1/gap_ratio of the member it joins (bytes fetched stay near read)
    gap_ratio: int = 16
    coalesce_span: int = 1 * MiB  # the largest coalesced GET (larger: later first bytes)
    coalesce_scan: int = 64  # coalesce with members announced this many entries ahead, or
    # as many as the buffer holds when that is more
    max_pending: int = 65536  # entries one connection may have announced and not yet read
    stale_lag: int = 4096  # unread entries this far behind the stream's reads are dropped
    miss_limit: int = 1024  # unmatched reads (buffer full, no hit) before a stream is reset
    # When the dataset fits the cache, whole-shard fetches serve an epoch; only its first
    # entries are fetched here (one GET each), so the first batch does not wait for those
    # fetches' frontiers to reach its files (a few duplicate bytes: the shards come whole too).
    fits_head: int = 32
    # When the dataset fits: fetch every announced member into its shard's part file, in
    # read order (see the module's docstring), instead of the head alone. On 16 cores the
    # cold epoch reaches 0.94-0.95x of the link against 0.89-0.90x with whole shards, for
    # 1.00x the bytes instead of ~1.07x; on 2 cores it is as fast as whole shards, not faster
    # (the FUSE workers serve every read, where whole shards' arrived files are pushed into
    # the page cache: more CPU). docs/benchmarks-notes.md, "Lookahead's fill, landed in the
    # arena". A GET's members are coalesced with shard neighbours announced within at
    # least fill_scan entries (a buffer's worth when that is more).
    fill_parts: bool = True
    fill_scan: int = 256
    # GETs in flight while filling: most bring one member (~100 KiB), so 16 of them with a
    # 20 ms first byte do not fill a 100 MB/s link (0.89-0.91x of it on 16 cores, 32:
    # 0.94-0.95x). On a faster link the fill is bound by them: 64 brought an uncapped
    # epoch's last batch 11-13 % sooner, the capped one unchanged (docs/benchmarks-notes.md,
    # session 26). Each costs the daemon ~0.4 ms of CPU (sources/h1.py).
    fill_requests: int = 64
    # The epoch's first reads are filled one member per GET (their bytes soonest), then GETs
    # take the member's neighbours too.
    fill_single_first: int = 64


class PartFiller(Protocol):
    """What ordered fills ask of the reader (shardfs/read/reader.py)."""

    def prepare_fills(self) -> None: ...

    def extent(self, shard: int, start: int, end: int) -> tuple[int, int]: ...

    @property
    def fills_ready(self) -> bool: ...

    def open_fill(self, shard: int) -> Fetch | None: ...

    def fills(self) -> list[Fetch]: ...

    def plan_fill_get(self, fetch: Fetch, start: int, stop: int) -> Get: ...

    async def run_fill_get(self, fetch: Fetch, get: Get,
                           on_chunk: Callable[[bytes], None] | None = None) -> int: ...


@dataclass(slots=True)
class LookaheadStats:
    connections: int = 0  # announcing connections open now
    connections_total: int = 0
    announced: int = 0  # entries accepted
    refused: int = 0  # entries over a connection's max_pending
    unknown: int = 0  # announced paths that are not files of the mount
    skipped: int = 0  # entries the reader serves anyway (cached / whole-shard / compressed)
    requests: int = 0  # ranged GETs
    bytes_fetched: int = 0  # bytes those GETs brought (members + coalescing gaps)
    gap_bytes: int = 0  # of which between coalesced members
    hits: int = 0  # reads served from the buffer
    hit_bytes: int = 0
    waits: int = 0  # of which waited for their GET to land
    urgent: int = 0  # entries fetched ahead of their turn because a read asked for them
    misses: int = 0  # reads of members not announced (or already dropped)
    stale: int = 0  # entries dropped unread
    stale_bytes: int = 0  # fetched bytes dropped unread
    resets: int = 0  # streams reset (new epoch or announcements not matching reads)
    errors: int = 0  # failed GETs (their reads fall back to the reader's own path)
    shared_hits: int = 0  # of the hits, served by FUSE workers from the shared arena
    shared_hits_in_c: int = 0  # of those, answered by the shim in C (fuse/arenareads.py)
    unshared: int = 0  # members held in daemon RAM: the arena had no free run that long
    buffered_bytes: int = 0  # held + in flight now
    peak_buffered_bytes: int = 0
    # Ordered fills (the dataset fits the cache): entries fetched into part files, the GETs
    # that brought them and their bytes (counted in the reader's shard_bytes, not in
    # bytes_fetched above), and the last GETs that completed shards (their ends, and bytes
    # no announcement asked for).
    part_entries: int = 0
    part_requests: int = 0
    part_bytes: int = 0
    part_errors: int = 0
    hole_requests: int = 0
    hole_bytes: int = 0


class _Slot:
    """One announced member occurrence."""

    __slots__ = ("arena_off", "data", "end", "event", "gen", "pos", "reserved", "served", "shard",
                 "start", "state", "stream")

    def __init__(self, stream: Stream, pos: int, shard: int, start: int, end: int) -> None:
        self.stream = stream
        self.pos = pos
        self.shard = shard
        self.start = start
        self.end = end
        self.state = _QUEUED
        self.data: bytes | bytearray = b""  # its bytes when not in the arena
        self.event: trio.Event | None = None
        self.served = 0  # bytes handed out so far
        self.reserved = 0  # buffer bytes counted for it
        self.arena_off = -1  # where its bytes are in the shared arena (-1: in `data`)
        self.gen = 0  # the arena generation of that place when they were put there

    @property
    def size(self) -> int:
        return self.end - self.start


class Stream:
    """The announcements of one connection, in order."""

    def __init__(self, owner: Lookahead, name: str) -> None:
        self.owner = owner
        self.name = name
        self.order: deque[_Slot] = deque()  # live (and some consumed) slots by position
        self.queue: deque[_Slot] = deque()  # slots not fetched yet, by position (lazy pops)
        self.next_pos = 0
        self.first_pos = 0  # position of the first entry since the last reset
        self.live = 0  # slots announced and not yet read or dropped
        self.cursor = -1  # highest position read so far
        self.misses_at_hit = owner.stats.misses
        self.closed = False
        self.last = False  # its epoch is announced to the end (until the next reset)

    def announce(self, refs: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
        """Append members (shard, offset, size); (accepted, refused over max_pending)."""
        return self.owner.announce(self, refs)

    def reset(self) -> None:
        self.owner.reset(self)

    def announced_all(self) -> None:
        """The stream's epoch is announced to its end: parts may be completed."""
        self.last = True
        self.owner.wake()

    def close(self) -> None:
        self.owner.close(self)


class _Landing:
    """A GET's bytes for a group of members of one shard, from offset `lo`, copied once,
    straight to where they are kept: each member gets its place when the GET starts (in the
    shared arena when there is room, else a buffer in RAM; `Lookahead._place`), and the bytes
    between members (tar headers) are not kept. A member is landed (readable) as soon as its
    own bytes are in, not when the whole GET is: a read waiting on it does not wait for the
    neighbours fetched with it."""

    def __init__(self, owner: Lookahead, group: list[_Slot], lo: int) -> None:
        self.owner, self.lo = owner, lo
        self.order = sorted(group, key=lambda s: s.start)
        self.pos = lo  # shard offset of the next byte to come
        self.first = 0  # order[:first] are complete
        for slot in self.order:
            owner._place(slot)

    @property
    def received(self) -> int:
        return self.pos - self.lo

    def add(self, chunk: bytes) -> None:
        pos, end = self.pos, self.pos + len(chunk)
        order, owner = self.order, self.owner
        with memoryview(chunk) as view:
            i = self.first
            while i < len(order) and order[i].start <= end:
                slot = order[i]
                a, b = max(slot.start, pos), min(slot.end, end)
                if a < b and slot.state == _INFLIGHT:
                    owner._put(slot, a - slot.start, view[a - pos : b - pos])
                if slot.end <= end and i == self.first:
                    self.first += 1
                    if slot.state == _INFLIGHT:
                        owner._landed(slot)
                i += 1
        self.pos = end


class Lookahead:
    def __init__(self, shards: Sequence[ShardInfo], sources: Sources,
                 policy: LookaheadPolicy | None = None, *,
                 covered: Callable[[int], bool] = lambda shard: False,
                 fits: Callable[[], bool] = lambda: False,
                 parts: PartFiller | None = None) -> None:
        self.shards = shards
        self.sources = sources
        self.policy = policy or LookaheadPolicy()
        self.covered = covered  # shards the reader serves without us
        self.fits = fits  # the dataset fits the cache: whole shards serve all but the head
        self.parts = parts  # writes members into part files when the dataset fits
        self._flush: set[int] = set()  # shards whose fill is to be completed first
        self.stats = LookaheadStats()
        # shard -> member offset -> its announced occurrences (per shard: a commit lets go
        # of the shard's members without visiting every other shard's)
        self._index: dict[int, dict[int, deque[_Slot]]] = {}
        self._queued: dict[int, list[int]] = {}  # shard -> sorted offsets of unfetched slots
        self._streams: deque[Stream] = deque()  # round robin: the next to fetch for is first
        self._requests = 0
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._names = itertools.count(1)
        self._paced = False  # the last scheduling round stopped at a full buffer
        # Shared with FUSE worker processes (see share()): fetched members go to the arena, and
        # where they are (or that they are gone) is published for the workers.
        self.arena: Arena | None = None
        self._no_arena = False  # making one failed
        self.landed: list[tuple[int, int, int, int]] = []  # (shard, member off, arena off, gen)
        self.gone: list[tuple[int, int, int, int]] = []  # (shard, member off, arena off, gen)
        self.published = trio.Event()  # set when members landed (or an arena is due)

    # -- streams ---------------------------------------------------------------------------
    def open_stream(self, peer: str = "") -> Stream:
        stream = Stream(self, f"{next(self._names)}{' ' + peer if peer else ''}")
        self._streams.append(stream)
        self.stats.connections += 1
        self.stats.connections_total += 1
        self.published.set()  # FUSE workers: time to share an arena (see share())
        return stream

    def announce(self, stream: Stream, refs: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
        if stream.closed:
            return 0, 0
        accepted = refused = 0
        room = self.policy.max_pending - stream.live
        index, queued = self._index, self._queued
        for shard, offset, size in refs:
            if size <= 0:
                continue
            if accepted >= room:
                refused += 1
                continue
            slot = _Slot(stream, stream.next_pos, shard, offset, offset + size)
            stream.next_pos += 1
            stream.order.append(slot)
            stream.queue.append(slot)
            stream.live += 1
            members = index.get(shard)
            if members is None:
                members = index[shard] = {}
            occurrences = members.get(offset)
            if occurrences is None:
                occurrences = members[offset] = deque()
            occurrences.append(slot)
            offsets = queued.get(shard)
            if offsets is None:
                offsets = queued[shard] = []
            bisect.insort(offsets, offset)
            accepted += 1
        self.stats.announced += accepted
        self.stats.refused += refused
        if accepted:
            self._wake.set()
        return accepted, refused

    def reset(self, stream: Stream) -> None:
        """Forget a stream's announcements (a new epoch starts, or they proved wrong)."""
        while stream.order:
            self._drop(stream.order.popleft(), stale=True)
        stream.queue.clear()
        stream.cursor = -1
        stream.first_pos = stream.next_pos
        stream.misses_at_hit = self.stats.misses
        stream.last = False
        self.stats.resets += 1
        self._flush_fills()  # the epoch before is over: complete what it left open
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def close(self, stream: Stream) -> None:
        if stream.closed:
            return
        stream.closed = True
        while stream.order:
            self._drop(stream.order.popleft(), stale=True)
        stream.queue.clear()
        self._streams.remove(stream)
        self.stats.connections -= 1
        self._flush_fills()
        self._wake.set()
        self._trim()

    # -- the read side ---------------------------------------------------------------------
    async def take(self, shard: int, member_off: int, member_size: int, start: int,
                   end: int) -> bytes | bytearray | None:
        """Bytes [start, end) (shard offsets within one member) if that member was announced;
        waits while its GET is in flight. None: not announced, dropped, or its GET failed
        (the reader then reads it its own way)."""
        slots = self._slots(shard, member_off)
        if not slots:
            self.stats.misses += 1
            return None
        slot = slots[0]  # the earliest announced occurrence
        if slot.end != member_off + member_size:  # the tree changed? never hand out guesses
            self.stats.misses += 1
            return None
        if slot.state == _QUEUED:
            self.stats.urgent += 1
            self._launch([slot])
        if slot.state == _INFLIGHT:
            self.stats.waits += 1
            assert slot.event is not None
            await slot.event.wait()
        if slot.state != _READY:  # its GET failed, or the stream dropped it meanwhile
            return None
        return self._serve(slot, start, end)

    def _serve(self, slot: _Slot, start: int, end: int) -> bytes | bytearray:
        """Bytes [start, end) of a landed member, counted as read."""
        if slot.arena_off >= 0:
            assert self.arena is not None
            at = slot.arena_off - slot.start
            data = bytes(self.arena.view[at + start : at + end])
        else:
            data = slot.data
            if start != slot.start or end != slot.end:
                data = data[start - slot.start : end - slot.start]
        self._served(slot, len(data))
        return data

    def landed_bytes(self, shard: int, member_off: int, start: int,
                     end: int) -> bytes | bytearray | None:
        """Bytes [start, end) of a member of a cached shard that landed here (its fill
        wrote past the page cache: `cached`), served as `take` serves them; None when it
        has not."""
        slots = self._slots(shard, member_off)
        if not slots or slots[0].state != _READY or end > slots[0].end:
            return None
        return self._serve(slots[0], start, end)

    def _slots(self, shard: int, member_off: int) -> deque[_Slot] | tuple[()]:
        """The announced occurrences of a member, earliest first (empty: none)."""
        return self._index.get(shard, {}).get(member_off, ())

    def taken(self, shard: int, member_off: int, arena_off: int, nbytes: int,
              in_c: bool = False) -> None:
        """A FUSE worker served nbytes of the member at arena_off from the arena itself (in
        C: its shim did)."""
        for slot in self._slots(shard, member_off):
            if slot.arena_off == arena_off and slot.state == _READY:
                self.stats.shared_hits += 1
                self.stats.shared_hits_in_c += in_c
                self._served(slot, nbytes)
                return

    def _served(self, slot: _Slot, nbytes: int) -> None:
        stats = self.stats
        stats.hits += 1
        stats.hit_bytes += nbytes
        slot.served += nbytes
        stream = slot.stream
        stream.misses_at_hit = stats.misses
        if slot.pos > stream.cursor:
            stream.cursor = slot.pos
            self._expire(stream)
        if slot.served >= slot.size and slot.state == _READY:
            self._drop(slot, stale=False)

    # -- fetching --------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the GETs; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.parts is not None and self.policy.fill_parts:
                nursery.start_soon(self._prepare_fills)
            task_status.started()
            while True:
                while self._schedule():
                    # The GETs launched so far go out first. Twice: a task started now runs
                    # in trio's next batch, where this loop's own turn may come before it
                    # (trio shuffles a batch); after a second checkpoint it has run.
                    await trio.sleep(0)
                    await trio.sleep(0)
                await self._wake.wait()
                self._wake = trio.Event()

    def _schedule(self) -> bool:
        """Launch GETs while there is room for them and entries to fetch; True where it
        stopped after LAUNCH_BATCH of them, with more to launch: the loop lets those send
        their requests before it plans the next (planning a fill opens its shard's part
        file: an epoch's first 64 GETs waited 25 ms for 28 of them, 15 ms in one)."""
        policy = self.policy
        launched = 0
        while self._requests < (policy.fill_requests if self._fill_mode() == "on"
                                else policy.max_requests):
            if launched >= LAUNCH_BATCH:
                return True
            if self._flush and self._complete_fill(self._flush):
                continue
            group = None
            self._paced = False
            for _ in range(len(self._streams)):
                stream = self._streams[0]
                self._streams.rotate(-1)
                group = self._next_group(stream)
                if group:
                    break
            if group:
                self._launch(group)
                launched += 1
                continue
            if self._paced and self._reset_mismatched():
                continue
            # Nothing announced left to fetch and every stream's epoch announced to its end
            # (or no stream left): the fills' ends come now.
            if not self._queued and all(s.last for s in self._streams) and \
                    self._complete_fill(None):
                continue
            return False
        return False

    def _next_group(self, stream: Stream) -> list[_Slot] | None:
        """The next GET for a stream: its first unfetched entry plus members of the same
        shard close to it among the next few entries; None when nothing fits the buffer."""
        queue, policy = stream.queue, self.policy
        while queue:
            head = queue[0]
            if head.state != _QUEUED:
                queue.popleft()
                continue
            mode = self._fill_mode()
            if mode == "wait":
                return None  # the shard layout is being built: entries wait for it
            if mode == "on" and not self.covered(head.shard) and \
                    self.parts is not None and self.parts.open_fill(head.shard) is not None:
                return self._fill_group(stream, head)
            if self.covered(head.shard) or head.size > policy.buffer_bytes or (
                    head.pos - stream.first_pos >= policy.fits_head and self.fits()):
                queue.popleft()
                self.stats.skipped += 1
                self._drop(head, stale=False)
                self._forget_done(stream)
                continue
            break
        else:
            return None
        room = policy.buffer_bytes - self.stats.buffered_bytes
        if head.size > room:
            self._paced = True  # wait for reads to free the buffer
            return None
        room -= head.size
        group, lo, hi = [head], head.start, head.end
        if head.pos - stream.first_pos < 2 * policy.max_requests:
            return group  # the epoch's first reads: one member per GET, the first bytes soonest
        gap, span, ratio = policy.coalesce_gap, policy.coalesce_span, policy.gap_ratio
        # Neighbours announced within about a buffer's worth of entries will be fetched before
        # they are read anyway: fetching them with the head saves a request each.
        horizon = head.pos + max(policy.coalesce_scan, policy.buffer_bytes // max(1, head.size))
        offsets = self._queued.get(head.shard, [])
        i = bisect.bisect_right(offsets, head.start)
        while i < len(offsets):  # members after the head, nearest first
            off = offsets[i]
            i += 1
            if off < hi:
                continue  # the head (or a member already taken) announced twice
            s = self._queued_at(head.shard, off, stream, horizon)
            if s is None or off - hi > min(gap, s.size // ratio) or s.end - lo > span \
                    or s.size > room:
                break
            group.append(s)
            hi = s.end
            room -= s.size
        i = bisect.bisect_left(offsets, head.start)
        while i > 0:  # members before the head, nearest first
            i -= 1
            s = self._queued_at(head.shard, offsets[i], stream, horizon)
            if s is None or lo - s.end > min(gap, s.size // ratio) or hi - s.start > span \
                    or s.size > room:
                break
            group.append(s)
            lo = s.start
            room -= s.size
        return group

    def _queued_at(self, shard: int, offset: int, stream: Stream, horizon: int) -> _Slot | None:
        """The stream's first unfetched announcement of a member, if within the horizon."""
        for s in self._slots(shard, offset):
            if s.state == _QUEUED and s.stream is stream and s.pos <= horizon:
                return s
        return None

    def _unqueue(self, slot: _Slot) -> None:
        offsets = self._queued[slot.shard]
        del offsets[bisect.bisect_left(offsets, slot.start)]
        if not offsets:
            del self._queued[slot.shard]

    def _reset_mismatched(self) -> bool:
        """The buffer is full and nothing can be fetched: reset streams whose reads keep
        missing (their announcements do not match what they read). True if any was."""
        limit = self.stats.misses - self.policy.miss_limit
        found = False
        for stream in list(self._streams):
            if stream.misses_at_hit < limit and stream.live:
                log.warning("lookahead: stream %s announces members its reads do not ask for; "
                            "dropping its announcements", stream.name)
                self.reset(stream)
                found = True
        return found

    def _launch(self, group: list[_Slot]) -> None:
        if self._fill_mode() == "on" and self.parts is not None:
            fetch = self.parts.open_fill(group[0].shard)
            if fetch is not None:
                self._launch_fill(group, fetch)
                return
        self._reserve(group)
        self._requests += 1
        assert self._nursery is not None, "Lookahead.run() must be started first"
        self._nursery.start_soon(self._fetch, group)

    def _reserve(self, group: list[_Slot]) -> None:
        """The group's entries leave the queue for a GET: in flight, their bytes counted in
        the buffer from now on."""
        for slot in group:
            self._unqueue(slot)
            slot.state = _INFLIGHT
            slot.event = trio.Event()
            slot.reserved = slot.size
            self.stats.buffered_bytes += slot.size
        if self.stats.buffered_bytes > self.stats.peak_buffered_bytes:
            self.stats.peak_buffered_bytes = self.stats.buffered_bytes

    def _settle(self, group: list[_Slot]) -> None:
        """A GET of the group ended: what it did not land (or was dropped in flight) is let
        go, and every read waiting on the group wakes."""
        for slot in group:
            if slot.state in (_INFLIGHT, _GONE):
                self._drop(slot, stale=False)
                self._release(slot)
            assert slot.event is not None
            slot.event.set()
        self._wake.set()

    async def _fetch(self, group: list[_Slot]) -> None:
        shard, lo, hi = group[0].shard, min(s.start for s in group), max(s.end for s in group)
        info = self.shards[shard]
        stats = self.stats
        landing = _Landing(self, group, lo)
        try:
            source = self.sources.for_url(info.url)
            async with contextlib.aclosing(source.stream(info, lo, hi)) as chunks:
                async for chunk in chunks:
                    landing.add(chunk)
            if landing.received != hi - lo:
                raise SourceError(f"{info.url}: {landing.received} bytes for range "
                                  f"[{lo}, {hi})")
            stats.gap_bytes += max(0, (hi - lo) - sum(s.size for s in group))
        except (SourceError, OSError) as exc:
            stats.errors += 1
            log.warning("lookahead: reading %s [%d, %d) failed: %s; its reads fall back",
                        info.url, lo, hi, exc)
        finally:
            stats.requests += 1
            stats.bytes_fetched += landing.received
            self._requests -= 1
            self._settle(group)

    # -- ordered fills: members into part files (the dataset fits the cache) --------------
    async def _prepare_fills(self) -> None:
        assert self.parts is not None
        try:
            await trio.to_thread.run_sync(self.parts.prepare_fills)
        except (OSError, MemoryError, ValueError) as exc:
            log.warning("lookahead: no ordered fills (%s); the head alone is fetched", exc)
            self.parts = None
        self._wake.set()

    def _fill_mode(self) -> str:
        """'on': announced members go to part files; 'wait': they will once the shard layout
        is built; 'off': RAM (dataset over the cache) or the head alone (fill_parts off)."""
        parts = self.parts
        if parts is None or not self.policy.fill_parts or not self.fits():
            return "off"
        return "on" if parts.fills_ready else "wait"

    def _fill_group(self, stream: Stream, head: _Slot) -> list[_Slot]:
        """The head and its shard neighbours whose extents join it, announced by the stream
        within a buffer's worth of entries (at least fill_scan), as many as the buffer has
        room for: one GET brings them all. Empty: the buffer is full (paced)."""
        policy, parts = self.policy, self.parts
        assert parts is not None
        room = policy.buffer_bytes - self.stats.buffered_bytes
        if head.size > room:
            self._paced = True  # wait for reads to free the buffer
            return []
        group = [head]
        if head.pos - stream.first_pos < policy.fill_single_first:
            return group  # the epoch's first reads: one member per GET, the first bytes soonest
        room -= head.size
        shard, span = head.shard, policy.coalesce_span
        lo, hi = parts.extent(shard, head.start, head.end)
        # as many entries as the buffer holds: they are fetched before being read anyway
        horizon = head.pos + max(policy.fill_scan, policy.buffer_bytes // max(1, head.size))
        offsets = self._queued.get(shard, [])
        # The members after the head, nearest first, then those before it.
        for i, step in ((bisect.bisect_right(offsets, head.start), 1),
                        (bisect.bisect_left(offsets, head.start) - 1, -1)):
            while 0 <= i < len(offsets):
                s = self._queued_at(shard, offsets[i], stream, horizon)
                i += step
                if s is None:
                    break
                a, b = parts.extent(shard, s.start, s.end)
                joins = a == hi if step > 0 else b == lo
                if not joins or max(b, hi) - min(a, lo) > span or s.size > room:
                    break
                group.append(s)
                lo, hi = min(a, lo), max(b, hi)
                room -= s.size
        return group

    def _launch_fill(self, group: list[_Slot], fetch: Fetch) -> None:
        """GET the group's extents into the fill. Usually none of those bytes is on disk or on
        its way: one GET that also lands the members for their reads. Otherwise (a read
        asked for some of them first) what is missing is fetched, and the entries are done
        here: their reads are served from the part file."""
        assert self.parts is not None
        extents = [self.parts.extent(fetch.shard, s.start, s.end) for s in group]
        lo, hi = min(a for a, _ in extents), max(b for _, b in extents)
        if fetch.missing(lo, hi) == [(lo, hi)]:
            self._launch_landing_fill(group, fetch, lo, hi)
            return
        for slot in group:
            self._drop(slot, stale=False)
        self.stats.part_entries += len(group)
        self._forget_done(group[0].stream)
        for a, b in fetch.missing(lo, hi):
            self._start_fill_get(fetch, a, b, hole=False)

    def _launch_landing_fill(self, group: list[_Slot], fetch: Fetch, lo: int, hi: int) -> None:
        """One GET of [lo, hi) into the fill that also lands the group's members for their
        reads, as _fetch does."""
        assert self.parts is not None and self._nursery is not None
        self._reserve(group)
        self.stats.part_entries += len(group)
        get = self.parts.plan_fill_get(fetch, lo, hi)
        self._requests += 1
        self._nursery.start_soon(self._fill_get, fetch, get, False, group)

    def cached(self, shard: int, *, keep_landed: bool = False) -> None:
        """The shard is in the cache now (its fill committed): its reads are served from
        there, so its members held or queued here are let go (they would hold the buffer
        until their stream's reads left them stale_lag entries behind). `keep_landed`: the
        fill bypassed the page cache (read/fillwrites.py), so members landed here stay for
        their reads, which they spare a disk read."""
        dropped = (_QUEUED,) if keep_landed else (_QUEUED, _READY)
        for slots in list(self._index.get(shard, {}).values()):
            for slot in list(slots):
                if slot.state in dropped:
                    self._drop(slot, stale=False)

    def bring(self, fetch: Fetch, start: int, end: int) -> None:
        """A read of a fill's member [start, end) that no GET brings yet: its GET now, ahead
        of its turn (and of max_requests: the read waits on it)."""
        if self.parts is None:
            return
        self.stats.urgent += 1
        for slot in list(self._slots(fetch.shard, start)):
            if slot.state == _QUEUED:
                self._drop(slot, stale=False)
                self.stats.part_entries += 1
        lo, hi = self.parts.extent(fetch.shard, start, end)
        for a, b in fetch.missing(lo, hi):
            self._start_fill_get(fetch, a, b, hole=False)

    def _flush_fills(self) -> None:
        if self.parts is not None:
            self._flush.update(f.shard for f in self.parts.fills())

    def _complete_fill(self, only: set[int] | None) -> bool:
        """Start one GET of bytes a fill misses that nothing brings (its end, members no
        announcement asked for): of a shard in `only`, or of any fill. False: none."""
        if self.parts is None:
            if only is not None:
                only.clear()
            return False
        for fetch in self.parts.fills():
            if only is not None and fetch.shard not in only:
                continue
            holes = fetch.missing(0, fetch.size)
            if holes:
                a, b = holes[0]
                self._start_fill_get(fetch, a, min(b, a + HOLE_SPAN), hole=True)
                return True
        if only is not None:
            only.clear()  # every one of them complete or on its way (or gone)
        return False

    def _start_fill_get(self, fetch: Fetch, start: int, stop: int, *, hole: bool) -> None:
        assert self.parts is not None and self._nursery is not None
        get = self.parts.plan_fill_get(fetch, start, stop)
        self._requests += 1
        self._nursery.start_soon(self._fill_get, fetch, get, hole)

    async def _fill_get(self, fetch: Fetch, get: Get, hole: bool,
                        group: list[_Slot] | None = None) -> None:
        """Run a fill's GET; with a group (_launch_landing_fill), land its members as their
        bytes come."""
        assert self.parts is not None
        stats = self.stats
        landing = _Landing(self, group, get.start) if group else None
        brought = 0
        try:
            brought = await self.parts.run_fill_get(fetch, get, landing.add if landing else None)
        except (SourceError, OSError) as exc:
            brought = get.pos - get.start  # (those written: the failure's count is rough)
            stats.part_errors += 1  # the fill fails: its reads read their members instead
            log.warning("lookahead: filling shard %d [%d, %d) failed: %s", fetch.shard,
                        get.start, get.stop, exc)
        finally:
            self._requests -= 1
            if hole:
                stats.hole_requests += 1
                stats.hole_bytes += brought
            else:
                stats.part_requests += 1
                stats.part_bytes += brought
            self._settle(group or [])

    # -- dropping --------------------------------------------------------------------------
    @staticmethod
    def _forget_done(stream: Stream) -> None:
        """Slots dropped at the front of a stream's order are kept for nothing: an epoch
        whose entries are all skipped (its shards cached) or fetched into part files would
        otherwise hold a slot per entry until the next reset."""
        order = stream.order
        while order and order[0].state == _GONE:
            order.popleft()

    def _expire(self, stream: Stream) -> None:
        """Drop what the stream's reads have left `stale_lag` entries behind."""
        order, horizon = stream.order, stream.cursor - self.policy.stale_lag
        while order and (order[0].state == _GONE or order[0].pos < horizon):
            self._drop(order.popleft(), stale=True)

    def _drop(self, slot: _Slot, *, stale: bool) -> None:
        if slot.state == _GONE:
            return
        if stale and slot.served == 0:
            self.stats.stale += 1
            if slot.state in (_READY, _INFLIGHT):
                self.stats.stale_bytes += slot.size
        members = self._index.get(slot.shard, {})
        slots = members.get(slot.start)
        if slots is not None:
            with contextlib.suppress(ValueError):
                slots.remove(slot)
            if not slots:
                del members[slot.start]
                if not members:
                    del self._index[slot.shard]
        inflight = slot.state == _INFLIGHT
        if slot.state == _QUEUED:
            self._unqueue(slot)
        slot.state = _GONE
        slot.stream.live -= 1
        if not inflight:  # an in-flight slot's bytes are released when its GET ends
            self._release(slot)
        self._wake.set()

    def _release(self, slot: _Slot) -> None:
        self.stats.buffered_bytes -= slot.reserved
        slot.reserved = 0
        slot.data = b""
        if slot.arena_off >= 0:
            assert self.arena is not None
            self.arena.free(slot.arena_off, slot.size)
            # Told with the next landing (a stale location is never read: see arena.py).
            self.gone.append((slot.shard, slot.start, slot.arena_off, slot.gen))
            slot.arena_off = -1
            self._trim()

    def _trim(self) -> None:
        """No stream left and the arena empty: give its memory back (it stays mapped)."""
        if self.arena is not None and not self._streams and self.arena.used == 0:
            self.arena.trim()

    # -- sharing with FUSE worker processes -------------------------------------------------
    def share(self) -> tuple[str, int, int] | None:
        """Keep fetched members in shared memory from now on; (path, total, data size) for
        ArenaView, or None when no arena can be made (members stay in daemon RAM)."""
        if self.arena is None:
            if self._no_arena:
                return None
            try:
                # Members in flight have their places too, each rounded up to whole blocks:
                # an eighth more than the buffer's bytes, so that rounding seldom leaves a
                # member out of the arena (in daemon RAM, served through the socket).
                self.arena = Arena(self.policy.buffer_bytes + self.policy.buffer_bytes // 8)
            except OSError as exc:
                self._no_arena = True  # said once; not tried again
                log.warning("lookahead: no shared arena (%s); workers get bytes by socket", exc)
                return None
        return self.arena.path, self.arena.total, self.arena.size

    def _place(self, slot: _Slot) -> None:
        """Where a member's bytes go as its GET brings them: the shared arena when there is
        one with room (its place counts as in use from now on; `_release` gives it back),
        else RAM."""
        arena = self.arena
        if arena is not None:
            at = arena.alloc(slot.size)
            if at is not None:
                slot.arena_off, slot.gen = at, arena.gen(at)
                return
            self.stats.unshared += 1
        slot.data = bytearray(slot.size)

    def _put(self, slot: _Slot, at: int, data: memoryview) -> None:
        """Bytes of a member in flight, from `at` in the member, into its place."""
        if slot.arena_off >= 0:
            assert self.arena is not None
            start = slot.arena_off + at
            self.arena.view[start : start + len(data)] = data
        else:
            slot.data[at : at + len(data)] = data

    def _landed(self, slot: _Slot) -> None:
        """All of a member's bytes are in: readable here, and by the workers when in the
        arena."""
        slot.state = _READY
        if slot.arena_off >= 0:
            self.landed.append((slot.shard, slot.start, slot.arena_off, slot.gen))
            self.published.set()
        assert slot.event is not None
        slot.event.set()

    def snapshot(self) -> dict[str, int]:
        return {**asdict(self.stats), "buffer_bytes": self.policy.buffer_bytes,
                "streams": len(self._streams)}
