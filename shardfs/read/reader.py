"""The read-ahead policy: what to fetch, when, and how much.

- A member whose shard is cached is read from the cache file with no await in between.
- Otherwise the read starts (or joins) a sequential whole-shard fetch and waits only until
  its own bytes have arrived — when its bytes are within `wait_ahead` of the fetch frontier.
- Reads far ahead of the frontier, reads of shards waiting for a fetch slot, and reads of
  shards that are not worth caching whole fetch just their member (or a block of a large
  member), so the bytes fetched stay close to the bytes read.

When is a whole shard worth caching? When the dataset fits in the cache budget, always. When
it does not, only while the *working set* — the distinct shards touched by the last
`window` reads (about one shard's worth of files, 32 to 512; one window per stream of
reads, see workingset.py) — fits in the budget. A shard-aware sampler (few shards in flight)
keeps the working set small, so whole shards stream through the cache; plain random access
over a dataset larger than the cache touches every shard, so the reader switches to member
reads instead of thrashing an LRU of whole shards.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import trio

from shardfs.cache.shardcache import DISK_FULL, PartFile, ShardCache
from shardfs.catalog.catalog import Catalog
from shardfs.catalog.codecs import CodecError
from shardfs.read.allowance import ColdStart, DuplicateAllowance
from shardfs.read.diskread import DiskReads
from shardfs.read.download import Downloads
from shardfs.read.errors import ReadError
from shardfs.read.fetch import Fetch, FetchFailed, Get
from shardfs.read.fetchqueue import FetchQueue
from shardfs.read.fillwrites import FillWrites
from shardfs.read.layout import ShardLayout
from shardfs.read.lookahead import Lookahead
from shardfs.read.memberreads import MemberReads
from shardfs.read.states import ShardStates
from shardfs.read.workingset import WorkingSet, runs_of
from shardfs.sources import ShardChanged, SourceError, Sources
from shardfs.util.checksum import VERIFY_MODES

log = logging.getLogger(__name__)
MiB = 1 << 20
MIN_PATIENCE = 0.02  # seconds; below this, waiting on a moving frontier is always right


@dataclass(slots=True)
class ReadPolicy:
    max_fetches: int = 8  # whole-shard fetches at once (8 vs 4: +14% cold epoch, bench)
    # Of those, fetches of shards announced (queue_ahead) and not read yet, and only while
    # fewer than ahead_below_fetches run in all: more would share the link with the shards
    # the readers wait for and delay the first batch (bench: 0.58-0.72 s vs 0.72-0.97 s
    # with all 8 slots open to them, the epoch as fast).
    max_ahead_fetches: int = 2
    ahead_below_fetches: int = 4
    max_member_fetches: int = 32  # member/block fetches at once
    wait_ahead: int = 16 * MiB  # a read this close ahead of a fetch's frontier waits for it
    # With no download's rate measured yet (a cold mount's first reads), a read further than
    # this ahead of the GET bringing its bytes reads its member at once, instead of waiting
    # out its patience (~0.1 s before anything is measured) first. At 100 MB/s 1 MiB is
    # ~10 ms, half a member GET's round trip. Bench (stock shuffle=True, --scale 3, 3 rounds
    # in turns): first batch 0.89-0.96 s against 0.96-1.05 s (docs/benchmarks-notes.md,
    # session 21).
    unmeasured_ahead: int = 1 * MiB
    # Recent reads that define the working set. None: the average number of files per shard,
    # clamped to 32..512 — a window longer than one shard's worth of reads would count the
    # shards a locality-preserving sampler has already finished as still in use.
    working_set_reads: int | None = None
    member_block: int = 4 * MiB  # larger members are fetched in blocks of this size
    # A read whose bytes an in-progress whole-shard fetch will not deliver within about two
    # member-read round trips (judged by the fetch's measured rate), or whose shard still
    # waits for a fetch slot, reads its member instead — as long as such duplicate bytes stay
    # under this fraction of the bytes of whole-shard fetches started (bytes fetched / read
    # stays near 1); past it, reads wait for the fetch. 10 %, the most issue #10 allows
    # (bytes fetched / read <= 1.1). Until session 18 each READ of a file read early counted
    # its member again, so the 10 % bought about half as many files (1.05-1.06x the bytes);
    # counted once, a cold shuffled epoch's first batch came at ~1.5-1.7 s instead of
    # 2.0-2.8 s, for 1.09x the bytes; 6 % gave back the bytes and the late first batch
    # (docs/benchmarks-notes.md, session 18). The bytes of shards queued for a slot count
    # as started (they will be fetched whole): otherwise the cold start (below), holding
    # downloads back, would hold the allowance back with them (session 21).
    early_member_fraction: float = 0.10
    # After the cold start (below) the allowance left lapses and it grows only by this
    # fraction of the bytes of downloads started or queued since. A member read costs the
    # link its bytes, which an epoch that fits the cache pays for in full, and buys only an
    # earlier read of one file: worth it for a worker's first batch, not after it. In the
    # bench's cold shuffled epoch (dataset fits, all shards queued within the first second)
    # 3.85-4.02 s, ~360 MB, against 4.03-4.09 s, 375 MB, with late_patience_s below
    # (docs/benchmarks-notes.md, session 33). Not 0: a dataset of many shards keeps queuing
    # new ones, and a read of one far back in the queue would wait for all before it.
    # With no cold start (cold_start_s 0), early_member_fraction holds throughout.
    late_member_fraction: float = 0.03
    # ...but a read that has waited this long may still take its member within the early
    # fraction: a worker whose first batch outlasts the cold start (a slower server, more
    # workers) must not wait for its shard's turn in the queue, a second or more, per read.
    # In the bench 4 runs in 20 had such a first batch of 1.7-2.4 s without it.
    late_patience_s: float = 0.25
    # The cold start: for cold_start_s from the first read that finds its shard not cached,
    # at most cold_start_fetches whole-shard downloads run (shards a read cannot take by
    # member reads — compressed ones, `shardfs warm` — are not held back). A cold mount's
    # first reads are member reads (their shards are queued for a slot), and each waits
    # behind the downloads' bytes on the link: with 8 downloads a member GET took ~41 ms
    # against ~21 ms with none, and a DataLoader worker's first batch is a chain of 32 of
    # them. Measured (stock shuffle=True, bench run --scale 3, in turns): with 2 downloads
    # for the first second, the first batch 0.94-0.98 s against 1.28-1.45 s (with
    # unmeasured_ahead), the epoch ~1.5 % longer; with none, 0.76 s but the epoch 4.8 s
    # against 4.0 (the link idle meanwhile); with 1, as late as with 2 and the epoch slower
    # (docs/benchmarks-notes.md, session 21).
    # 0 seconds: no cold start.
    cold_start_fetches: int = 2
    cold_start_s: float = 1.0
    # Only shards at least this large are held back: a small shard comes whole about as soon
    # as a member does (0.73 MiB shards, 20 ms a request: held back, the bench's small-file
    # epoch took 0.56-0.59 s against 0.46-0.50 s and its first batch came later, 87 requests
    # instead of 29; held back, `bench run --quick`'s 4 MiB shards cost its epoch 3 %).
    cold_start_min_shard: int = 8 * MiB
    # Downloads started while the cold start runs have their connections' receive windows
    # capped where a queue is seen on the way (sources/window.py), so that the first reads'
    # member GETs do not wait behind their bytes in the link's queue: on the bench's link
    # each member GET of the first batch took 33-34 ms on average against 25-27
    # (docs/benchmarks-notes.md, "The cold start's downloads with small receive windows").
    # Off: the kernel's autotuned windows (`--small-windows off`).
    cold_start_small_windows: bool = True
    # Such a read whose member lies wholly ahead of the GET bringing it may split that GET
    # instead (see _split): its member comes by a GET of its own, written into the part
    # file. Off by default: the GET cut short has bytes in flight past its new end (socket
    # buffers), measured 1.27x the bytes and no faster (docs/benchmarks-notes.md, session 9).
    # At most max_gets_per_fetch GETs per fetch.
    split_fetches: bool = False
    max_gets_per_fetch: int = 16
    # A shard's download takes the members that reads fetched early (in the member cache)
    # and GETs only the bytes between them (Downloads._reuse_member_reads). Reads of a shard
    # still queued then cost the link nothing twice: the late fraction and its lapse are not
    # for them (the early fraction holds throughout, in case the member cache turns over
    # before the download starts), so a first batch that outlasts the cold start does not
    # wait late_patience_s per read of a queued shard.
    reuse_member_reads: bool = True
    member_cache: int = 64 * MiB  # RAM for recently fetched members/blocks
    prefetch: str = "touched"  # "touched": shards once read; "all": warm all if they fit
    # What a complete fetch is checked against (util/checksum.py): "auto", the index's
    # CRC-32C where it has one (a tenth of sha256's CPU), else its sha256; "sha256", its
    # sha256 where it has one.
    verify: str = "auto"

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}")


@dataclass(slots=True)
class ReaderStats:
    reads: int = 0
    bytes_served: int = 0
    cache_hits: int = 0  # reads served from a complete cached shard
    frontier_hits: int = 0  # served from a shard still being fetched, bytes already there
    waits: int = 0  # reads that waited for a fetch's frontier
    member_fetches: int = 0
    member_bytes: int = 0
    # Member reads of shards a whole-shard fetch also brings (its frontier too slow, or its
    # fetch still queued for a slot): duplicate bytes, bounded by early_member_fraction.
    early_member_reads: int = 0
    early_member_bytes: int = 0
    # Of those, reads of shards queued for a fetch slot (not waiting on a download's frontier;
    # most in the cold start).
    queued_member_reads: int = 0
    # Reads of a member an earlier read fetched (or is fetching): a file is read in several
    # READs (128 KiB each), and only its first fetches the member. Served from the member
    # cache, without waiting on a download and without counting against the allowance.
    member_hits: int = 0
    # Reads that split a whole-shard fetch (their member fetched once, by its own GET), and
    # the bytes received past a GET's new end before it stopped (discarded).
    split_reads: int = 0
    split_overrun_bytes: int = 0
    # Members read early (in the member cache when their shard's download started) that the
    # download took instead of fetching their bytes again, and those bytes.
    reused_member_reads: int = 0
    reused_member_bytes: int = 0
    shard_fetches_started: int = 0
    ahead_fetches: int = 0  # of those, started for shards a sampler announced (queue_ahead)
    shard_fetches_done: int = 0
    # Shards filled by the Lookahead's member GETs into their part files (no whole-shard
    # GET; the dataset fits the cache): opened, and of those committed (also counted in
    # shard_fetches_done).
    fills_started: int = 0
    fills_done: int = 0
    # Fill bytes written to the part file with O_DIRECT (read/fillwrites.py), and fills
    # checked from their GETs' CRC-32Cs (no read back of the part file).
    fill_direct_bytes: int = 0
    fills_checked_from_gets: int = 0
    shard_bytes: int = 0
    # Whole-shard fetches an earlier daemon left unfinished (kill -9, restart), continued
    # from the bytes its part file holds: the bytes kept (not fetched again), and the bytes
    # its record claimed that failed their CRC check (fetched again).
    resumed_fetches: int = 0
    resumed_bytes: int = 0
    resume_rejected_bytes: int = 0
    fetch_errors: int = 0
    eio: int = 0


class Reader:
    def __init__(self, catalog: Catalog, cache: ShardCache, sources: Sources,
                 policy: ReadPolicy | None = None, *, states: ShardStates | None = None) -> None:
        self.catalog = catalog
        self.cache = cache
        self.sources = sources
        self.policy = policy or ReadPolicy()
        self.stats = ReaderStats()
        self.fetches: dict[int, Fetch] = {}
        self._fills = 0  # of those, filled by the Lookahead (see open_fill): no fetch slot
        self._forced: set[int] = set()  # asked for by `shardfs warm`: fetch whatever the policy
        self.failed: set[int] = set()  # shards whose last whole-shard fetch failed
        # Announced by a sampler as read next (queue_ahead), in its order, with the
        # announcing connection: waiting or being fetched, until read or its fetch ends.
        self._ahead: OrderedDict[int, Hashable] = OrderedDict()
        # Shards whose whole download did not match their index (digest, size): downloading
        # them again would fail again, so the policy serves them by member reads instead
        # (unless they can only be read whole: compressed shards).
        self._mismatched: set[int] = set()
        policy = self.policy
        self.members = MemberReads(catalog, sources, self.stats, block_size=policy.member_block,
                                   cache_bytes=policy.member_cache,
                                   max_in_flight=policy.max_member_fetches)
        self._nursery: trio.Nursery | None = None
        # Bytes each shard takes in the cache: the plain tar size (compressed shards are
        # decompressed into the cache).
        self.sizes = catalog.cached_sizes()
        self.codecs = catalog.shard_codecs()
        # Shards read only whole (compressed, or on a server without Range support).
        self.whole_only = catalog.whole_only or [c is not None for c in self.codecs]
        # Reads waiting for their shard's fetch slot (compressed shards, or the duplicate
        # allowance spent), by shard.
        self._slot_waiters: dict[int, trio.Event] = {}
        self.dataset_bytes = sum(self.sizes)
        # The shards fetched into the cache: what must fit its budget for "the dataset fits"
        # (shards read in place, linked before the reader starts, take no room in it).
        self.fetched_bytes = sum(size for size, key in zip(self.sizes, catalog.keys, strict=True)
                                 if not cache.is_linked(key))
        self._queue = FetchQueue(self.sizes)  # shards waiting for a fetch slot
        files = catalog.tree.count_files()
        per_shard = files // max(1, len(catalog.shards))
        self.window = self.policy.working_set_reads or min(512, max(32, per_shard))
        self.working_set = WorkingSet(self.sizes, self.window)
        self.disk = DiskReads()
        # What is on disk, for worker processes (see states.py); kept in step with the cache.
        self.states = states or ShardStates(len(catalog.shards))
        self._shards_of_key: dict[str, list[int]] = {}
        for shard, key in enumerate(catalog.keys):
            self._shards_of_key.setdefault(key, []).append(shard)
            if cache.has(key):
                self.states.complete(shard)
        cache.on_evict = self._evicted
        self._whole_bytes_started = 0  # bytes of all whole-shard fetches started
        self.cold_start = ColdStart(policy.cold_start_s)
        self.downloads = Downloads(catalog, sources, self.policy, self.stats, self.states,
                                   self.members, self.codecs, self.cold_start)
        self.allowance = DuplicateAllowance(
            self.stats, self.cold_start, early_fraction=policy.early_member_fraction,
            late_fraction=policy.late_member_fraction, late_patience_s=policy.late_patience_s)
        self._held: set[int] = set()  # queued shards the cold start kept from starting
        self.started = time.monotonic()
        self.lookahead: Lookahead | None = None  # announced reads (shardfs/daemon/announce.py)
        # Each file's record in its shard, for fills (built by prepare_fills, in a thread).
        self.layout = ShardLayout(catalog.tree, self.sizes)
        # Called with a shard's number once its whole fetch is in the cache (the FUSE layer
        # pushes its files into the kernel's page cache: shardfs/fuse/pagepush.py).
        self.on_complete: Callable[[int], None] | None = None
        # Reads being answered, by arrival (dicts keep insertion order: the first is oldest).
        self._active: dict[int, float] = {}
        self._read_seq = 0
        # Set when the daemon exits for a new one to take the mount over (shardfs restart):
        # fetches in flight leave their part files for it to continue, instead of deleting
        # them.
        self.keep_partial = False
        # Part files an earlier daemon left (cache.kept): continued at run() if their shard
        # is in this mount and can be fetched by ranges; the others are deleted now.
        self._resume: list[int] = []
        for key in cache.kept:
            ranged = [s for s in self._shards_of_key.get(key, ()) if not self.whole_only[s]]
            if ranged and not cache.has(key):
                self._resume.append(ranged[0])
            else:
                cache.drop_kept(key)

    # -- lifecycle -------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the background fetch tasks; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = self.downloads.nursery = nursery
            for shard in self._resume:  # downloads in flight when the last daemon ended
                self._forced.add(shard)
                self._enqueue(shard)
            self._resume.clear()
            self._start_queued()
            if self.policy.prefetch == "all" and self._dataset_fits():
                for shard in range(len(self.catalog.shards)):
                    if not self.cache.has(self.catalog.keys[shard]):
                        self._enqueue(shard)
                self._start_queued()
            task_status.started()
            await trio.sleep_forever()

    def _evicted(self, key: str) -> None:
        for shard in self._shards_of_key.get(key, ()):
            self.states.gone(shard)

    def note_reads(self, stream: Hashable, shards: list[int], nbytes: int, cache_hits: int,
                   frontier_hits: int) -> None:
        """Reads served from the cache files without this reader (by the shim in C, by a
        worker process), noted in a batch: they count in the working set (in their own
        stream, see workingset.py), the LRU order and the stats as if they had been read
        here."""
        stats = self.stats
        stats.reads += len(shards)
        stats.bytes_served += nbytes
        stats.cache_hits += cache_hits
        stats.frontier_hits += frontier_hits
        runs = runs_of(shards)
        self.working_set.note_runs(stream, runs)
        # Once per run of one shard's reads: touching a shard again right after itself
        # changes no order.
        keys = self.catalog.keys
        for shard, _ in runs:
            self.cache.touch(keys[shard])
        if self._ahead:
            self._read_ahead(shard for shard, _ in runs)

    def _dataset_fits(self) -> bool:
        return self.fetched_bytes <= self.cache.budget

    def _whole_fetches(self) -> int:
        """Fetches that hold a fetch slot: all but fills (their GETs are the Lookahead's)."""
        return len(self.fetches) - self._fills

    # -- the read path ---------------------------------------------------------------------
    async def read(self, shard: int, member_off: int, member_size: int, off: int,
                   size: int) -> bytes | bytearray:
        """Bytes [off, off+size) of a member (clipped to its end); ReadError -> EIO."""
        token = self._arrived()
        try:
            data = await self._read(shard, member_off, member_size, off, size, True)
        finally:
            del self._active[token]
        assert data is not None
        return data

    async def read_or_locate(self, shard: int, member_off: int, member_size: int, off: int,
                             size: int) -> bytes | bytearray | None:
        """For FUSE worker processes: as `read`, but None (instead of the bytes) once they are
        on local disk in the shard's cache file — `states` says where — so the worker reads
        them itself; bytes only when they came from a member read."""
        token = self._arrived()
        try:
            return await self._read(shard, member_off, member_size, off, size, False)
        finally:
            del self._active[token]

    @property
    def member_fetches_in_flight(self) -> int:
        """Member/block GETs running now (deduplicated: one per block however many wait)."""
        return self.members.in_flight

    def _arrived(self) -> int:
        """Note a read from its arrival (`reads_in_flight`, `oldest_read_s`); the caller
        deletes its token when it is answered (try/finally inline: a context manager costs
        about 1 us more per read on the daemon's hot path)."""
        token = self._read_seq = self._read_seq + 1
        self._active[token] = time.monotonic()
        return token

    def in_flight(self) -> tuple[int, float | None]:
        """Reads being answered now, and how long the oldest of them has waited (seconds)."""
        if not self._active:
            return 0, None
        return len(self._active), time.monotonic() - next(iter(self._active.values()))

    async def _local(self, fd: int, size: int, start: int, want: bool) -> bytes | bytearray | None:
        return await self.disk.pread(fd, size, start) if want else None

    async def _read(self, shard: int, member_off: int, member_size: int, off: int, size: int,
                    want: bool) -> bytes | bytearray | None:
        if off >= member_size or size <= 0:
            return b""
        size = min(size, member_size - off)
        start = member_off + off
        end = start + size
        stats = self.stats
        stats.reads += 1
        stats.bytes_served += size
        self.working_set.touch(shard)
        if shard in self._ahead:
            self._read_ahead((shard,))
        key = self.catalog.keys[shard]
        cached = self.cache.get(key)
        if cached is not None:
            # (a member a fill wrote directly is in the arena still, not in the page cache)
            if self.lookahead is not None and \
                    (data := self.lookahead.landed_bytes(shard, member_off, start, end)):
                return data
            stats.cache_hits += 1
            return await self._local(cached.fd, size, start, want)  # type: ignore[arg-type]
        if self.whole_only[shard]:
            return await self._read_compressed(shard, key, start, end, want)
        if self.lookahead is not None:  # announced by a training process: fetched ahead
            data = await self.lookahead.take(shard, member_off, member_size, start, end)
            if data is not None:
                return data
            fetch = self.fetches.get(shard)  # the take may have opened the shard's fill
            if fetch is not None and fetch.fill:
                return await self._read_filled(fetch, key, member_off, member_size, start,
                                               end, want)
        member = self.members.block_of(member_off, member_size, start)
        if self.members.covers(shard, member_off, member_size, start, end):
            # An earlier read of this member (a file is read in several READs) fetched it, or
            # is fetching it: no wait, and no new bytes to count against the allowance.
            stats.member_hits += 1
            return await self.members.read(shard, member_off, member_size, start, end)
        fetch = await self._fetch_for(shard, key, member[1] - member[0])
        if fetch is None and (cached := self.cache.get(key)) is not None:
            stats.cache_hits += 1  # its fetch completed while this read waited for it
            return await self._local(cached.fd, size, start, want)  # type: ignore[arg-type]
        if fetch is not None and fetch.failed is None:
            if fetch.has(start, end):
                stats.frontier_hits += 1
                return await self._from_part(fetch, start, end, want)
            if fetch.to_go(start) <= self.policy.wait_ahead:
                if await self._wait(fetch, key, start, end, member):
                    return await self._from_part(fetch, start, end, want)
            elif self._split(fetch, *member) and await self._wait(fetch, key, start, end, None):
                return await self._from_part(fetch, start, end, want)
        return await self.members.read(shard, member_off, member_size, start, end)

    async def _from_part(self, fetch: Fetch, start: int, end: int,
                         want: bool) -> bytes | bytearray | None:
        """Bytes of a fetch in progress. Workers are told only the prefix (states.py): bytes
        past it come back as bytes even when `want` is False."""
        return await self._local(fetch.part.fd, end - start, start, want or end > fetch.arrived)

    async def _fetch_for(self, shard: int, key: str, member_bytes: int) -> Fetch | None:
        """The whole-shard fetch this read may wait on (started now if the policy says so),
        or None: read the member. A shard queued for a fetch slot will be fetched whole, so a
        member read of it now fetches bytes twice: that is allowed within the duplicate
        allowance (`early_member_fraction`), else the read waits for the fetch to start."""
        if not self.cold_start.begun:
            self._begin_cold_start()
        began = time.monotonic()
        while True:
            fetch = self.fetches.get(shard) or self._maybe_start(shard)
            if fetch is not None or shard not in self._queue or self.cache.has(key):
                return fetch
            waited = time.monotonic() - began
            taken_later = self.downloads.reuses_members(shard)
            if self.allowance.allows(member_bytes, self._started_bytes(), waited,
                                     taken_later=taken_later):
                self.allowance.spend(member_bytes)
                self.stats.queued_member_reads += 1
                return None
            if shard in self._held:  # held by the cold start only: better fetched than waited for
                self._queue.discard(shard)
                self._start_one_queued(shard)
                return self.fetches.get(shard)  # None: no room for it, read the member
            event = self._slot_waiters.setdefault(shard, trio.Event())
            # Set when the shard's fetch starts or it leaves the queue, and when the
            # allowance grew (a whole fetch started, a shard was queued); after the cold
            # start, look again once the read has waited late_patience_s.
            late = 0.0 if taken_later else self.allowance.late_wait(waited)
            with trio.move_on_after(late if late > 0 else math.inf):
                await event.wait()

    def _patience(self, fetch: Fetch) -> float:
        """How long a read waits on a frontier before reading its member instead: about two
        member-read round trips (measured; before any, the fetch's time to first byte)."""
        rtt = self.members.rtt if self.members.rtt is not None else fetch.ttfb
        return max(MIN_PATIENCE, 2 * (rtt if rtt is not None else 0.05))

    def _eta(self, fetch: Fetch, start: int, end: int) -> float | None:
        """Seconds until a fetch brings bytes [start, end): at the measured rate of the GET
        bringing them; before that GET has a rate (it just started), at the rate the other
        whole-shard downloads get now, shared with one more, after their time to first byte.
        None: nothing measured yet. (Without the guess, a read far into a shard whose
        download it had just started waited its full patience before reading its member.)"""
        eta = fetch.eta(start, end)
        get = fetch.covering(end - 1)
        if eta is not None or get is None:
            return eta
        now = time.monotonic()
        rates, ttfbs = [], []
        for other in self.fetches.values():
            if other is fetch or other.fill or not other.gets:
                continue
            rate = other.gets[0].rate(now)
            if rate is not None and other.ttfb is not None:
                rates.append(rate)
                ttfbs.append(other.ttfb)
        if not rates:
            return None
        rate = sum(rates) / (len(rates) + 1)  # the link shared with one more download
        starts_in = 0.0 if get.first_byte is not None else \
            max(0.0, sum(ttfbs) / len(ttfbs) - (now - fetch.began))
        return starts_in + (end - get.pos) / rate

    def _started_bytes(self) -> int:
        """Bytes of whole-shard downloads started or queued: what the duplicate allowance is
        a fraction of (queued shards will be fetched whole; counting them keeps the cold
        start, which holds downloads back, from holding the allowance back with them)."""
        return self._whole_bytes_started + self._queue.nbytes

    async def _wait(self, fetch: Fetch, key: str, start: int, end: int,
                    member: tuple[int, int] | None) -> bool:
        """Wait until a fetch has bytes [start, end): True when they are in its part file
        (read them before the next await). False: read the member instead — the fetch died
        of a local cause, or (when `member`, the range a member read would fetch, is given)
        it would take longer than a member read and the member could not split the fetch."""
        self.stats.waits += 1
        self.cache.pin(key)  # the shard may complete meanwhile; it must not be evicted under us
        began = time.monotonic()
        try:
            if member is not None:
                patience = self._patience(fetch)
                eta = self._eta(fetch, start, end)
                far = eta > patience if eta is not None else \
                    fetch.to_go(start) > self.policy.unmeasured_ahead
                if far and self._read_member_instead(fetch, member):
                    return False
                with trio.move_on_after(patience):
                    await fetch.wait_for(start, end)
                if not fetch.has(start, end) and fetch.failed is None:
                    eta = self._eta(fetch, start, end)  # the rate is known better by now
                    if (eta is None or eta > patience) and \
                            self._read_member_instead(fetch, member):
                        return False
                    late = self.allowance.late_wait(time.monotonic() - began)
                    if late > 0:  # the late allowance said no
                        with trio.move_on_after(late):
                            await fetch.wait_for(start, end)
                        if not fetch.has(start, end) and fetch.failed is None and \
                                self._read_member_instead(fetch, member,
                                                          time.monotonic() - began):
                            return False
            await fetch.wait_for(start, end)
            # Our bytes arrived; but if the fetch failed before this task ran again, its part
            # file is closed (its fd number may already name another file).
            return fetch.failed is None
        except FetchFailed as exc:
            # The source failed the download past its deadline. A read that waited on it for
            # much of that fails with it; one that joined it late (the server may be back by
            # now: a held-back download of the cold start failed 0.3 s into a test's reads
            # after an outage) reads its member, with a deadline of its own (or the grace of
            # one request timeout while the source is still down: sources/http.py). Not a
            # read of a compressed shard (`member` None: read only whole), nor of a shard
            # replaced, nor of a split fetch (a GET of its own brought the read's member).
            # "Late": it waited less than half the download's life (a read that started the
            # download, as the kernel's retry of a failed read does, fails with it).
            now = time.monotonic()
            if isinstance(exc.cause, SourceError) and (
                    member is None or fetch.split or isinstance(exc.cause, ShardChanged)
                    or now - began >= (now - fetch.began) / 2):
                self.stats.eio += 1
                raise ReadError(str(exc.cause)) from None
            return False  # e.g. the local disk filled up: fall back to member reads
        finally:
            self.cache.unpin(key)

    def _read_member_instead(self, fetch: Fetch, member: tuple[int, int],
                             waited: float = 0.0) -> bool:
        """A read the fetch would keep waiting too long (it has waited `waited` s): split the
        fetch (the read then waits for its member's own GET: False), else read the member if
        the duplicate allowance lets it (True)."""
        if self._split(fetch, *member):
            return False
        nbytes = member[1] - member[0]
        if not self.allowance.allows(nbytes, self._started_bytes(), waited):
            return False
        self.allowance.spend(nbytes)
        return True

    def _split(self, fetch: Fetch, start: int, end: int) -> bool:
        """Fetch member bytes [start, end) by a GET of their own, into the part file, if the
        GET that would bring them has not reached them yet: that GET stops at `start` and a
        new one brings what followed `end`. No byte is fetched twice (unlike an early member
        read); the price is up to two more requests. False: not split (the policy, a shard
        read only whole, bytes on their way already, GETs at their limit)."""
        if not self.policy.split_fetches or self.whole_only[fetch.shard] or \
                fetch.nursery is None or fetch.failed is not None or fetch.error is not None:
            return False
        get = fetch.covering(start)
        if get is None or get.pos >= start or end > get.stop:
            return False  # the member is next in line (or under way), or not all in one GET
        more = 1 + (end < get.stop)
        if len([g for g in fetch.gets if g.running]) + more > self.policy.max_gets_per_fetch:
            return False
        member, rest = Get(start, end), Get(end, get.stop)
        try:
            fetch.nursery.start_soon(self.downloads.run_get, fetch, member)
        except RuntimeError:  # the fetch is ending: its GETs are all done
            return False
        get.stop = start
        fetch.gets = [g for g in fetch.gets if g.running]
        fetch.gets.append(member)
        if rest.running:
            fetch.gets.append(rest)
            fetch.nursery.start_soon(self.downloads.run_get, fetch, rest)
        fetch.split = True
        self.stats.split_reads += 1
        return True

    async def _read_compressed(self, shard: int, key: str, start: int, end: int,
                               want: bool) -> bytes | bytearray | None:
        """A compressed shard, or one on a server without Range support, has no member
        reads: wait for (or start) its whole fetch."""
        while True:
            cached = self.cache.get(key)
            if cached is not None:
                fd: int = cached.fd  # type: ignore[assignment]
                return await self._local(fd, end - start, start, want)
            fetch = self.fetches.get(shard)
            if fetch is None and self._whole_fetches() < self.policy.max_fetches:
                fetch = self._start(shard)
                if fetch is None:
                    self.stats.eio += 1
                    what = "compressed shard" if self.codecs[shard] else \
                        "shard (its server ignores Range requests)"
                    raise ReadError(f"{self.catalog.shards[shard].url}: the cache cannot hold "
                                    f"this {what}, {self.sizes[shard]} bytes, which can only "
                                    "be read whole; give it a larger --cache-size")
            if fetch is None:  # every slot busy: queue it ahead of the policy and wait
                self._forced.add(shard)
                self._enqueue(shard)
                event = self._slot_waiters.setdefault(shard, trio.Event())
                await event.wait()
                continue
            if fetch.failed is None and fetch.has(start, end):
                self.stats.frontier_hits += 1
                return await self._local(fetch.part.fd, end - start, start, want)
            if not await self._wait(fetch, key, start, end, None):
                self.stats.eio += 1
                raise ReadError(f"{self.catalog.shards[shard].url}: {fetch.failed}")
            return await self._local(fetch.part.fd, end - start, start, want)

    # -- shards filled by the Lookahead's member GETs -------------------------------------
    # When the dataset fits the cache, the Lookahead fetches announced members in read order
    # into their shard's part file (each GET taking the member's headers with it: layout.py),
    # and the shard is committed once every byte is in, its digest checked from the part
    # file. Such a fill has no whole-shard GET and holds no fetch slot; a read of it waits on
    # the GET that brings its member.
    def prepare_fills(self) -> None:
        """Build the shard layout fills need (in a thread: a pass over every file)."""
        self.layout.build()

    @property
    def fills_ready(self) -> bool:
        return self.layout.ready

    def extent(self, shard: int, start: int, end: int) -> tuple[int, int]:
        """The bytes a fill's GET takes for member [start, end): with its headers."""
        return self.layout.extent(shard, start, end)

    def open_fill(self, shard: int) -> Fetch | None:
        """The shard's fill, opened now if need be; None when the shard is served otherwise
        (cached, fetched whole, compressed, a failed or mismatched download before) or the
        cache has no room for it."""
        fetch = self.fetches.get(shard)
        if fetch is not None:
            return fetch if fetch.fill else None
        if (self.whole_only[shard] or shard in self.failed or shard in self._mismatched
                or not self._dataset_fits() or self.cache.has(self.catalog.keys[shard])):
            return None
        # No record of progress: a fill's bytes arrive in read order, scattered over the
        # shard, not as a prefix; a daemon taking a half-filled shard over fetches it anew.
        part = self._begin_part(shard, record=False)
        if part is None:
            return None
        fetch = Fetch(shard, part, part.size)
        fetch.gets = []
        fetch.fill = fetch.split = True  # split: the bytes arrive in runs, out of order
        direct = self.downloads.direct_writes(part.fd)
        check = self.catalog.check(shard, self.policy.verify)
        fetch.writes = FillWrites(part, direct,
                                  crcs=check is not None and check.kind == "crc32c")
        self.fetches[shard] = fetch
        self._fills += 1
        self._queue.discard(shard)
        self.stats.fills_started += 1
        assert self._nursery is not None, "Reader.run() must be started before fills"
        self._nursery.start_soon(self._run_fill, fetch)
        self._wake_slot_waiter(shard)
        return fetch

    def fills(self) -> list[Fetch]:
        return [f for f in self.fetches.values() if f.fill and f.failed is None]

    def plan_fill_get(self, fetch: Fetch, start: int, stop: int) -> Get:
        """A GET of bytes [start, stop) into a fill, counted as on its way from now (run it
        with run_fill_get)."""
        get = Get(start, stop)
        fetch.gets.append(get)
        return get

    async def run_fill_get(self, fetch: Fetch, get: Get,
                           on_chunk: Callable[[bytes], None] | None = None) -> int:
        """Stream a planned GET into the fill's part file (Downloads.run_fill_get); the bytes
        it received."""
        return await self.downloads.run_fill_get(fetch, get, on_chunk)

    async def _run_fill(self, fetch: Fetch) -> None:
        """Commit a fill once every byte is in and its digest matches the index."""
        shard = fetch.shard
        info, key = self.catalog.shards[shard], self.catalog.keys[shard]
        check = self.catalog.check(shard, self.policy.verify)
        writes = fetch.writes
        assert writes is not None
        began = time.monotonic()
        try:
            try:
                await fetch.wait_for(0, fetch.size)
            except FetchFailed as exc:
                raise (exc.cause if isinstance(exc.cause, Exception)
                       else SourceError(str(exc))) from None
            if check is not None:
                digest = writes.digest(fetch.size)
                self.stats.fills_checked_from_gets += digest is not None
                await self.downloads.check_whole(fetch, info.url, check, digest)
            writes.close()
            await self.cache.commit(fetch.part)
            self.states.complete(shard)
            self.stats.shard_fetches_done += 1
            self.stats.fills_done += 1
            # Written directly, its bytes are on the disk, not in the page cache: the members
            # the arena holds are read from there still, and nothing is pushed from the disk.
            if self.lookahead is not None:
                self.lookahead.cached(shard, keep_landed=writes.direct)
            if self.on_complete is not None and not writes.direct:
                self.on_complete(shard)
            log.info("filled shard %s: %d bytes in %.2f s", info.url, info.size,
                     time.monotonic() - began)
        except (SourceError, OSError, CodecError) as exc:
            self._failed_for_good(fetch, exc, "filling")
            self._drop_failed_part(fetch, key, exc)
        except BaseException as exc:  # cancelled at shutdown: release waiters, drop the part
            fetch.fail(exc)
            self.cache.abort(fetch.part, key)
            self.states.gone(shard)
            raise
        finally:
            writes.close()
            del self.fetches[shard]
            self._fills -= 1
            self._start_queued()

    def _failed_for_good(self, fetch: Fetch, exc: Exception, doing: str) -> None:
        """A shard's download (whole, or a fill) failed: not tried again this session (a
        content mismatch: never fetched whole again), its waiters woken."""
        shard = fetch.shard
        self.stats.fetch_errors += 1
        self.failed.add(shard)
        if isinstance(exc, ShardChanged):
            self._mismatched.add(shard)
        log.error("%s shard %s failed: %s", doing, self.catalog.shards[shard].url, exc)
        fetch.fail(exc)

    def _drop_failed_part(self, fetch: Fetch, key: str, exc: Exception) -> None:
        self.cache.abort(fetch.part, key)
        self.states.gone(fetch.shard)
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            self.cache.disk_full()  # fit the budget to the disk; waiters read members

    async def _read_filled(self, fetch: Fetch, key: str, member_off: int, member_size: int,
                           start: int, end: int, want: bool) -> bytes | bytearray | None:
        """A read of a shard being filled: served from the part file once its bytes are in.
        Bytes no GET brings yet are asked for now (ahead of their turn); if the fill fails,
        the member is read by itself."""
        shard = fetch.shard
        if fetch.has(start, end):
            self.stats.frontier_hits += 1
            return await self._from_part(fetch, start, end, want)
        if self.lookahead is not None and fetch.failed is None and not fetch.coming(start, end):
            self.lookahead.bring(fetch, member_off, member_off + member_size)
        if fetch.failed is None and fetch.coming(start, end):
            self.stats.waits += 1
            self.cache.pin(key)  # it may be committed meanwhile: not evicted under us
            try:
                with contextlib.suppress(FetchFailed):
                    await fetch.wait_for(start, end)
                # Our bytes arrived; if the fill failed before this task ran again, its part
                # file is closed (its fd number may already name another file).
                if fetch.failed is None and fetch.has(start, end):
                    return await self._from_part(fetch, start, end, want)
            finally:
                self.cache.unpin(key)
        return await self.members.read(shard, member_off, member_size, start, end)

    def _whole_shard_pays(self) -> bool:
        return self._dataset_fits() or self.working_set.nbytes <= self.cache.budget

    # -- whole-shard fetches ---------------------------------------------------------------
    def _maybe_start(self, shard: int) -> Fetch | None:
        if not self._whole_shard_pays():
            return None
        if shard in self._mismatched and not self.whole_only[shard]:
            return None
        if self._whole_fetches() >= self._fetch_slots(shard):
            if self._whole_fetches() < self.policy.max_fetches:
                # Held back by the cold start only: started when it ends, as it would have
                # been now (by then a random reader's working set may have outgrown the
                # cache; the shards it started with are worth having: bench "over", a
                # quarter of the reads hit them).
                self._held.add(shard)
            self._enqueue(shard)
            return None
        return self._start(shard)

    def _begin_part(self, shard: int, *, record: bool) -> PartFile | None:
        """Room in the cache and a part file for the shard's download (whole or a fill);
        None: no room without evicting shards in use, or the part could not be made (its
        reads read their members instead)."""
        url, key = self.catalog.shards[shard].url, self.catalog.keys[shard]
        if not self.cache.reserve(key, self.sizes[shard]):
            return None
        try:
            return self.cache.begin(key, self.sizes[shard], record=record)
        except OSError as exc:
            self.cache.abort(None, key)
            log.warning("cannot cache %s (%s); reading its members directly", url, exc)
            if exc.errno in DISK_FULL:
                self.cache.disk_full()
            return None

    def _start(self, shard: int) -> Fetch | None:
        info = self.catalog.shards[shard]
        # A shard read only whole (compressed, or its server ignores Range) cannot be
        # continued from the middle: no record, so a new daemon starts it from 0. Nor is
        # one in a file worth a record: checking the kept bytes would read as much as
        # fetching them again, and the CRCs cost ~0.5 ms of CPU per MiB here.
        record = not self.whole_only[shard] and not self.sources.is_local(info.url)
        part = self._begin_part(shard, record=record)
        if part is None:
            return None
        fetch = Fetch(shard, part, part.size)
        self.fetches[shard] = fetch
        self._whole_bytes_started += self.sizes[shard]
        self._queue.discard(shard)
        self._held.discard(shard)
        self.stats.shard_fetches_started += 1
        assert self._nursery is not None, "Reader.run() must be started before reads"
        self._nursery.start_soon(self._run_fetch, fetch)
        self._wake_slot_waiters()
        return fetch

    def _wake_slot_waiters(self) -> None:
        """A whole-shard download started, so the duplicate allowance grew: every read
        waiting for a slot looks again, and may read its member now. (Woken only when their
        own shard started, reads of a cold shuffled epoch, its allowance spent within ~1 s,
        waited up to 1.4 s in the first batch: docs/benchmarks-notes.md, session 19.)"""
        waiters, self._slot_waiters = self._slot_waiters, {}
        for event in waiters.values():
            event.set()

    def _wake_slot_waiter(self, shard: int) -> None:
        event = self._slot_waiters.pop(shard, None)
        if event is not None:
            event.set()

    def _enqueue(self, shard: int) -> None:
        if self._queue.add(shard):
            self._wake_slot_waiters()  # the allowance grew by a tenth of its bytes

    # -- the cold start (ReadPolicy.cold_start_s) ------------------------------------------
    def _begin_cold_start(self) -> None:
        self.cold_start.begin()
        if self.cold_start.seconds > 0 and self._nursery is not None:
            self._nursery.start_soon(self._end_cold_start)

    async def _end_cold_start(self) -> None:
        await trio.sleep(self.cold_start.seconds)
        self._start_queued()

    def _fetch_slots(self, shard: int | None = None) -> int:
        """Whole-shard downloads that may run now for this shard (None: any): fewer in the
        cold start, for shards of at least `cold_start_min_shard`."""
        policy = self.policy
        if self.cold_start.running() and (
                shard is None or self.sizes[shard] >= policy.cold_start_min_shard):
            return min(policy.cold_start_fetches, policy.max_fetches)
        return policy.max_fetches

    def _start_queued(self) -> None:
        if self._queue and self.cold_start.running():
            # The cold start holds back the shards that reads can take member by member:
            # forced ones (`shardfs warm`, resumed downloads, reads of shards that can only
            # be read whole) start as slots allow, in their order.
            for shard in self._queue:
                if self._whole_fetches() >= self.policy.max_fetches:
                    break
                if shard in self._forced or self._whole_fetches() < self._fetch_slots(shard):
                    self._queue.discard(shard)
                    self._start_one_queued(shard)
            self._start_ahead()
            return
        while self._queue and self._whole_fetches() < self.policy.max_fetches:
            self._start_one_queued(self._queue.popleft())
        self._start_ahead()

    def _start_one_queued(self, shard: int) -> None:
        """Start a shard taken off the queue, if it is still wanted and not in already."""
        self._wake_slot_waiter(shard)  # whatever happens next, a waiter looks again
        held = shard in self._held
        self._held.discard(shard)
        forced = shard in self._forced or held
        wanted = forced or self.policy.prefetch == "all" or shard in self.working_set
        if shard in self.fetches or self.cache.has(self.catalog.keys[shard]) or not wanted:
            self._forced.discard(shard)
            return
        if (forced or self._whole_shard_pays()) and self._start(shard) is None:
            self._forced.discard(shard)  # no room even after eviction: give up on it

    # -- shards announced ahead (shard-aware samplers) -------------------------------------
    def queue_ahead(self, shards: Sequence[int], owner: Hashable) -> int:
        """Shards a sampler says it reads next (ShardAwareSampler, through the announce
        socket), in its order: fetched whole in that order (see _start_ahead), so the link is
        busy with the sampler's next shards before its readers touch them. Only when the
        dataset fits the cache: otherwise shards held for later would make the cache evict
        shards being read and fetch them again (measured: 1.6-1.8x the bytes in the bench's
        over-cache scenario), so announcements are ignored. Returns how many shards were
        added (not cached, fetching or announced already). `owner` names the announcing
        connection (see forget_ahead)."""
        if not self._dataset_fits():
            return 0
        added = 0
        for shard in shards:
            key = self.catalog.keys[shard]
            if (shard in self._ahead or shard in self.fetches or self.cache.has(key)
                    or shard in self._mismatched or shard in self.failed):
                continue
            self._ahead[shard] = owner
            added += 1
        self._start_ahead()
        return added

    def forget_ahead(self, owner: Hashable) -> None:
        """The announcing connection closed: its shards not fetched yet are not awaited."""
        for shard in [s for s, o in self._ahead.items() if o == owner]:
            del self._ahead[shard]

    def _read_ahead(self, shards: Iterable[int]) -> None:
        """Announced shards read now: their readers fetch them if they are not in yet."""
        gone = False
        for shard in shards:
            if self._ahead.pop(shard, None) is not None:
                gone = True
        if gone:
            self._start_ahead()

    def _start_ahead(self) -> None:
        """Start the announced shards' fetches in announcement order: at most
        max_ahead_fetches of them at once, and only while fewer than ahead_below_fetches
        fetches run in all (more would share the link with the shards the readers wait for)."""
        if not self._ahead or not self._dataset_fits():
            return
        policy = self.policy
        running = sum(s in self._ahead for s in self.fetches)
        for shard in list(self._ahead):
            below = min(self._fetch_slots(shard), policy.ahead_below_fetches)
            if running >= policy.max_ahead_fetches or self._whole_fetches() >= below:
                return
            if shard in self.fetches:
                continue
            if self._start(shard) is None:
                del self._ahead[shard]  # cached already, or no room: nothing to fetch ahead
                continue
            self.stats.ahead_fetches += 1
            running += 1

    async def _run_fetch(self, fetch: Fetch) -> None:
        shard = fetch.shard
        info, key = self.catalog.shards[shard], self.catalog.keys[shard]
        began = time.monotonic()
        again = False  # fetch it again from byte 0 (a continued fetch that did not check out)
        try:
            await self.downloads.download(fetch)
            await self.cache.commit(fetch.part)
            self.states.complete(shard)
            self.stats.shard_fetches_done += 1
            if self.on_complete is not None:
                self.on_complete(shard)
            self.failed.discard(shard)
            took = time.monotonic() - began
            log.info("fetched shard %s: %d bytes in %.2f s (%.1f MB/s)", info.url, info.size,
                     took, info.size / max(took, 1e-6) / 1e6)
        except (SourceError, OSError, CodecError) as exc:
            again = isinstance(exc, ShardChanged) and fetch.part.resumed
            if again:
                # The bytes kept from the earlier daemon may be what differs (they passed
                # their CRCs, but the digest or size did not): fetch the shard again from 0
                # before judging it; waiters read their members meanwhile (not EIO).
                log.warning("continued fetch of shard %s failed its check (%s): fetching it "
                            "again from byte 0", info.url, exc)
                fetch.fail(OSError(f"{info.url}: fetched again from byte 0"))
            else:
                self._failed_for_good(fetch, exc, "fetching")
            self._drop_failed_part(fetch, key, exc)
        except BaseException as exc:  # cancelled at shutdown: release waiters, drop the part
            fetch.fail(exc)
            if self.keep_partial:  # unless a new daemon takes the mount over: it goes on
                self.cache.leave(fetch.part)
            else:
                self.cache.abort(fetch.part, key)
            self.states.gone(shard)
            raise
        finally:
            del self.fetches[shard]
            self._forced.discard(shard)
            self._ahead.pop(shard, None)  # fetched (or failed): no longer awaited ahead
            if again:
                self._forced.add(shard)
                self._enqueue(shard)
            self._start_queued()

    def warm(self, shards: list[int]) -> dict[str, int | list[int]]:
        """Queue whole-shard fetches (for `shardfs warm`) for as many shards as the budget holds.

        Shards are taken in the given order; those that would push the total past the cache
        budget are left out rather than evicting shards warmed a moment earlier."""
        left = self.cache.budget
        planned: list[int] = []
        cached = over = 0
        total = 0
        for shard in shards:
            size, key = self.sizes[shard], self.catalog.keys[shard]
            if size > left:
                over += 1
                continue
            left -= size
            total += size
            planned.append(shard)
            if self.cache.has(key) or shard in self.fetches:
                cached += self.cache.has(key)
                continue
            self.failed.discard(shard)
            self._forced.add(shard)
            self._enqueue(shard)
        self._start_queued()
        return {"shards": planned, "bytes": total, "already_cached": cached, "over_budget": over}

    def warm_progress(self, shards: list[int]) -> dict[str, int | bool]:
        cached = sum(self.cache.has(self.catalog.keys[s]) for s in shards)
        failed = sum(s in self.failed for s in shards)
        busy = any(s in self.fetches or s in self._queue for s in shards)
        return {"total": len(shards), "cached": cached, "failed": failed, "idle": not busy}
