"""Whole-shard downloads: one shard's bytes streamed into its part file, checked, ready to
commit.

A download is one sequential GET of the shard (`Downloads.download`): its bytes are written
into the part file as they come and announced to the reads waiting on them (`write`, then
`ShardStates.arrived`), and on their way they feed, in a worker thread, the whole shard's
digest, the resume record's block CRCs (cache/partrecord.py) and, for a compressed shard, its
decompressor. Reads far ahead of the frontier may split it (reader.py, `Reader._split`): the
GETs a split adds write their parts through `run_get`; a `Lookahead` fill writes its GETs'
bytes through `write` too. Before its GET, a download continues the part an earlier daemon
left (`_resume_part`), or takes the members reads fetched early while it was queued
(`_reuse_member_reads`). At the end the shard is checked against its index (`check_whole`);
committing it into the cache, and what a failure does, is the reader's (`Reader._run_fetch`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing, suppress
from typing import TYPE_CHECKING, Any

import trio

from shardfs.cache.directwrite import DirectWrites, Staged
from shardfs.cache.partrecord import BLOCK, PrefixCrcs, block_crcs
from shardfs.catalog.catalog import Catalog
from shardfs.catalog.codecs import CodecError, decompressor
from shardfs.read.allowance import ColdStart
from shardfs.read.fetch import NEVER, Fetch, Get
from shardfs.read.memberreads import MemberReads
from shardfs.read.states import ShardStates
from shardfs.sources import ShardChanged, SourceError, Sources, Written
from shardfs.sources.window import SMALL_WINDOW
from shardfs.util.checksum import Digest, KnownDigest, ShardCheck, crc32c_value, digest_of_file
from shardfs.util.fileio import file_views, pwrite_all

if TYPE_CHECKING:
    from shardfs.read.reader import ReaderStats, ReadPolicy

log = logging.getLogger(__name__)
THREAD_BATCH = 4 << 20  # bytes of a fetch handed to a thread at once (digest, decompression)
# Names of the threads doing this work while they do it (`top -H`, bench cpusplit).
HASH_THREAD = "shardfs hash"
WRITE_THREAD = "shardfs write"  # members read early, written into their shard's part file


class Downloads:
    """The reader's whole-shard downloads and the writes of every GET into a part file."""

    def __init__(self, catalog: Catalog, sources: Sources, policy: ReadPolicy,
                 stats: ReaderStats, states: ShardStates, members: MemberReads,
                 codecs: list[str | None], cold_start: ColdStart) -> None:
        self.catalog = catalog
        self.cold_start = cold_start
        self.sources = sources
        self.policy = policy
        self.stats = stats
        self.states = states
        self.members = members
        self.codecs = codecs
        self.nursery: trio.Nursery | None = None  # the reader's, once it runs
        # O_DIRECT writes of fills (None: not used), probed at the first fill
        self.direct: DirectWrites | None = None
        self._direct_probed = False

    def direct_writes(self, fd: int) -> DirectWrites | None:
        """The O_DIRECT writer fills use (None: through the page cache), probed on the first
        fill's part file (every part file is on the cache's file system)."""
        if not self._direct_probed:
            self.direct, self._direct_probed = DirectWrites.probe(fd), True
        return self.direct

    async def download(self, fetch: Fetch) -> None:
        """Stream the fetch's shard into its part file and check it against its index:
        SourceError, OSError or CodecError (ShardChanged where it does not match) if not.
        Started while the cold start runs, for a shard of the size it holds back
        (`cold_start_min_shard`), its connection's receive window is capped where its bytes
        are seen queuing on the way (sources/window.py): the first reads' member GETs then do
        not wait behind them at the link's bottleneck. (Smaller shards are not held back:
        all of them download at once, and the first reads wait for those downloads.)"""
        policy = self.policy
        small = (policy.cold_start_small_windows and self.cold_start.running()
                 and fetch.size >= policy.cold_start_min_shard)
        token = SMALL_WINDOW.set(small)
        try:
            await self._download(fetch)
        finally:
            SMALL_WINDOW.reset(token)

    async def _download(self, fetch: Fetch) -> None:
        shard = fetch.shard
        info = self.catalog.shards[shard]
        check = self.catalog.check(shard, self.policy.verify)
        record = fetch.part.record
        # The index's CRC-32C is checked from the record's block CRCs (PrefixCrcs.whole), not
        # by a pass of its own over the bytes.
        from_blocks = (check is not None and check.kind == "crc32c" and record is not None
                       and record.kind == "crc32c")
        digest = check.digest() if check is not None and not from_blocks else None
        codec = self.codecs[shard]
        plain = decompressor(codec) if codec else None

        first = fetch.gets[0]
        reused: list[tuple[int, bytes]] = []  # members read early, in the part file
        if fetch.part.resumed:  # bytes an earlier daemon wrote: checked, then kept
            first.start = first.pos = await self._resume_part(fetch, digest)
        elif plain is None:
            reused = await self._reuse_member_reads(fetch)
        # The record's CRCs come from the bytes as they stream, in the hashing thread; once
        # a split has other GETs write parts of the prefix, from the part file instead
        # (record_blocks).
        crcs = (PrefixCrcs(first.start, fetch.size, record.kind, record.crcs)
                if record is not None else None)
        fetch.record_due = NEVER if crcs is not None else self.next_record(fetch)

        def read_back_crcs() -> None:  # the fetch was split
            nonlocal crcs
            if crcs is not None:
                crcs = None
                fetch.record_due = self.next_record(fetch)

        def record_crcs() -> None:
            nonlocal crcs
            if crcs is None or record is None:
                return
            try:
                record.extend(crcs.take())
            except OSError as exc:
                crcs = None
                record.unrecorded(exc)

        def append_from_thread(piece: bytes) -> None:
            trio.from_thread.run_sync(self.write, fetch, first, piece)

        def check_and_decode(chunks: list[bytes | Written]) -> None:  # in a thread
            for piece in chunks:
                # Bytes the source wrote into the part file itself are read back from
                # its page cache here, off the loop's thread.
                views = file_views(fetch.part.fd, piece.offset, piece.size) \
                    if isinstance(piece, Written) else (piece,)
                for chunk in views:
                    if digest is not None:
                        digest.update(chunk)
                    if crcs is not None:
                        crcs.update(chunk)
                if plain is not None:  # (bytes: a compressed shard is never written)
                    assert isinstance(piece, bytes)
                    # Output in bounded pieces: a small input may inflate to gigabytes.
                    plain.feed_into(piece, append_from_thread)

        async def first_get() -> None:
            # Hashing and decompressing cost milliseconds per MiB; hashlib, zlib, zstd,
            # lz4 and our CRC-32C (util/checksum.py) release the GIL, so a worker thread
            # keeps them off the loop that answers FUSE requests. A thread hop costs
            # ~100 us, and HTTP yields ~64 KiB at a time: chunks go to the thread in
            # batches of THREAD_BATCH. Plain bytes are written (and announced to
            # readers) at once; the digest is checked before commit (from the part
            # file, if reads split the fetch: see Reader._split).
            batch: list[bytes | Written] = []
            batched = 0
            # A batch also goes when the prefix passes a block's end, so that the block's
            # CRC is recorded then (not only once 4 MiB more came: a stalled GET).
            cut = (first.start // BLOCK + 1) * BLOCK
            source = self.sources.for_url(info.url)
            if first.start >= info.size:  # all written before the last daemon ended
                return
            # A file:// source writes the part file in the thread that reads the shard
            # (FileSource.stream_into), off the loop; only where no split can move this
            # GET's end while a write is under way (the policy does not split).
            stream_into = getattr(source, "stream_into", None)
            written = plain is None and stream_into is not None and \
                not self.policy.split_fetches

            async def pieces() -> AsyncIterator[tuple[bytes | Written, bool]]:
                """The shard's bytes in order, and whether they came now: a GET of
                each run between the members read early, and those members (written
                already) in their places."""
                pos = first.start
                for start, data in [*reused, (info.size, b"")]:
                    if start > pos:
                        run = stream_into(info, pos, start, fetch.part.fd) if written \
                            else source.stream(info, pos, start)
                        async with aclosing(run) as chunks:
                            async for chunk in chunks:
                                yield chunk, True
                    if data:
                        yield data, False
                    pos = start + len(data)

            async with aclosing(pieces()) as chunks:
                async for chunk, fetched in chunks:
                    if not fetched:  # a member read early: on disk since the start
                        first.pos += len(chunk)
                    else:
                        self.stats.shard_bytes += len(chunk)
                        if plain is None:
                            self.write(fetch, first, chunk, written=written)
                            if fetch.split:
                                read_back_crcs()
                                if not first.running:
                                    break  # the rest comes by the GETs of the split
                    if (digest is None or fetch.split) and crcs is None and plain is None:
                        continue
                    batch.append(chunk)
                    batched += len(chunk)
                    if batched >= THREAD_BATCH or (crcs is not None and first.pos >= cut):
                        await trio.to_thread.run_sync(check_and_decode, batch,
                                                      thread_name=HASH_THREAD)
                        record_crcs()
                        batch, batched = [], 0
                        cut = (first.pos // BLOCK + 1) * BLOCK
            if batch:
                await trio.to_thread.run_sync(check_and_decode, batch,
                                              thread_name=HASH_THREAD)
                record_crcs()
            if plain is not None:
                self.write(fetch, first, plain.finish())

        async with trio.open_nursery() as nursery:
            fetch.nursery = nursery  # the GETs a split adds run here
            await self.guard_get(fetch, first_get())
        fetch.nursery = None
        if fetch.error is not None:
            raise fetch.error
        if fetch.arrived != fetch.part.size:
            raise ShardChanged(f"{info.url}: {fetch.arrived} bytes of tar, its index "
                               f"says {fetch.part.size}")
        if check is not None:
            if fetch.split:  # its bytes came by several GETs: from the part file
                digest = None
            elif from_blocks:  # None where the record's CRCs gave out: from the part file
                whole = crcs.whole() if crcs is not None else None
                digest = KnownDigest(whole) if whole is not None else None
            await self.check_whole(fetch, info.url, check, digest)

    def reuses_members(self, shard: int) -> bool:
        """The shard's download will take its members read early (see below)."""
        policy = self.policy
        return policy.reuse_member_reads and not policy.split_fetches and \
            not self.sources.is_local(self.catalog.shards[shard].url)

    async def _reuse_member_reads(self, fetch: Fetch) -> list[tuple[int, bytes]]:
        """Members of the shard that reads fetched early (its download still queued, most in
        the cold start), found in the member cache, written into the part file now; the
        download then GETs the runs between them, one after another, and takes these in
        their places (in order, so its checks and record see every byte as before). Those
        bytes cross the link once, not twice; each costs the download one more request (its
        other downloads keep the link busy meanwhile). Returned by offset. Not for a shard in
        a file (no link to spare: a member read cost a local read), nor with `split_fetches`
        (a split moves a GET's end), nor past `max_gets_per_fetch` requests."""
        if not self.reuses_members(fetch.shard):
            return []
        taken: list[tuple[int, bytes]] = []
        pos = 0
        for start, data in self.members.cached_in(fetch.shard):
            end = start + len(data)
            if start < pos or end > fetch.size or len(taken) + 2 > self.policy.max_gets_per_fetch:
                continue
            taken.append((start, data))
            pos = end
        if not taken:
            return taken

        def write() -> None:  # up to 15 blocks of up to 4 MiB: off the loop's thread
            for start, data in taken:
                pwrite_all(fetch.part.fd, data, start)  # OSError: fails the fetch, as a GET's

        # Meanwhile reads of these members are served from the member cache, which holds them.
        await trio.to_thread.run_sync(write, thread_name=WRITE_THREAD)
        for start, data in taken:
            fetch.filled(start, len(data))
        fetch.first_byte = None  # its time to first byte is its GETs' (Reader._eta)
        if fetch.arrived:
            self.states.arrived(fetch.shard, fetch.arrived)
        self.stats.reused_member_reads += len(taken)
        self.stats.reused_member_bytes += sum(len(data) for _, data in taken)
        return taken

    async def check_whole(self, fetch: Fetch, url: str, check: ShardCheck,
                           digest: Digest | None) -> None:
        """ShardChanged unless the fetched shard matches its index's digest: `digest` as
        computed while its bytes came, or (None) one read back from the part file."""
        if digest is None:
            digest = await trio.to_thread.run_sync(digest_of_file, check, fetch.part.fd,
                                                   fetch.size, thread_name=HASH_THREAD)
        if not check.matches(digest):
            raise ShardChanged(f"{url}: content differs from its index ({check.kind})")

    async def _resume_part(self, fetch: Fetch, digest: Any | None) -> int:
        """A part file an earlier daemon left: check the blocks its record claims against
        their CRCs (feeding `digest` the bytes that pass), and count the prefix that passes
        as arrived. Returns where the rest of the shard is to be fetched from."""
        record = fetch.part.record
        assert record is not None
        claimed = record.claimed
        kept = await trio.to_thread.run_sync(record.verify_prefix, fetch.part.fd, digest,
                                             thread_name=HASH_THREAD)
        stats = self.stats
        stats.resumed_fetches += 1
        stats.resumed_bytes += kept
        stats.resume_rejected_bytes += claimed - kept
        if kept:
            fetch.filled(0, kept)
            self.states.arrived(fetch.shard, kept)
        log.info("continuing the fetch of shard %s from byte %d of %d%s",
                 self.catalog.shards[fetch.shard].url, kept, fetch.size,
                 f" ({claimed - kept} bytes recorded failed their check)" if kept < claimed
                 else "")
        return kept

    @staticmethod
    def next_record(fetch: Fetch) -> int:
        """Where the prefix must reach for the part's record to take its next block."""
        record = fetch.part.record
        if record is None:
            return NEVER
        due = (len(record.crcs) + 1) * BLOCK
        return due if due < fetch.size else NEVER  # the last block: the fetch commits soon

    async def record_blocks(self, fetch: Fetch) -> None:
        """Append the CRCs of the prefix's complete blocks not recorded yet to the part's
        record (read back from the part file in a thread, so the record never claims bytes
        not written), so that a daemon taking over continues the fetch from there. For a
        split fetch only: an unsplit one records the CRCs computed as its bytes stream
        (`download`, PrefixCrcs)."""
        record = fetch.part.record
        assert record is not None
        while fetch.failed is None:
            start = len(record.crcs) * BLOCK
            stop = min(fetch.arrived, fetch.size - 1) // BLOCK * BLOCK
            if stop <= start:
                break
            try:
                record.extend(await trio.to_thread.run_sync(
                    block_crcs, fetch.part.fd, start, stop, record.kind, thread_name=HASH_THREAD))
            except OSError as exc:
                record.unrecorded(exc)
                return
        fetch.record_due = self.next_record(fetch)

    async def guard_get(self, fetch: Fetch, get: Coroutine[Any, Any, None]) -> None:
        """Run one GET of a fetch; its failure ends them all (and the fetch, with that
        error): kept as `fetch.error`, not raised, so the GETs' nursery raises no group."""
        try:
            await get
        except (SourceError, OSError, CodecError) as exc:
            if fetch.error is None:
                fetch.error = exc
                fetch.fail(exc)  # at once: a reader woken by the last bytes must not use them
            if fetch.nursery is not None:
                fetch.nursery.cancel_scope.cancel()

    async def run_get(self, fetch: Fetch, get: Get) -> None:
        """A GET a split added (see Reader._split): bytes [get.pos, get.stop) into the part file."""
        info = self.catalog.shards[fetch.shard]

        async def stream() -> None:
            source = self.sources.for_url(info.url)
            async with aclosing(source.stream(info, get.pos, get.stop)) as chunks:
                async for chunk in chunks:
                    self.stats.shard_bytes += len(chunk)
                    self.write(fetch, get, chunk)
                    if not get.running:
                        break  # split again: its end moved

        await self.guard_get(fetch, stream())

    def write(self, fetch: Fetch, get: Get, data: bytes | Written, *,
               written: bool = False) -> None:
        """Bytes that `get` brought, at its position; past its end (moved by a split) they are
        dropped. `written`: the source wrote them into the part file already."""
        room = get.stop - get.pos
        if len(data) > room:
            if not fetch.split:  # never write past the reservation
                raise ShardChanged(f"shard holds more than the {fetch.part.size} bytes indexed")
            self.stats.split_overrun_bytes += len(data) - room
            data = data[:room]
        if not data:
            return
        at = get.pos
        if not written:
            pwrite_all(fetch.part.fd, data, at)  # all of it, or OSError: no holes
        self.wrote(fetch, get, at, len(data))

    def wrote(self, fetch: Fetch, get: Get, at: int, n: int) -> None:
        """`get` wrote bytes [at, at + n) of the part file (at its position): count them."""
        if get.first_byte is None:  # the GET's rate (Get.eta) is measured from here
            get.first_byte = time.monotonic()
        get.pos += n
        before = fetch.arrived
        fetch.filled(at, n)
        if fetch.arrived != before:
            self.states.arrived(fetch.shard, fetch.arrived)  # written, then announced
            if fetch.arrived >= fetch.record_due and fetch.nursery is not None:
                fetch.record_due = NEVER  # until this round of recording is done
                with suppress(RuntimeError):  # RuntimeError: the fetch is ending
                    fetch.nursery.start_soon(self.record_blocks, fetch)

    # -- the GETs of a Lookahead fill (reader.py, "shards filled by the Lookahead") ----------
    async def run_fill_get(self, fetch: Fetch, get: Get,
                           on_chunk: Callable[[bytes], None] | None = None) -> int:
        """Stream a planned GET into the fill's part file; the bytes it received. Its
        failure (the source's own retries spent) fails the fill: its readers read their
        members instead. Written directly, its last bytes may still be on their way to the
        disk when it returns (they count as arrived once they are there: the fill commits
        after them)."""
        info = self.catalog.shards[fetch.shard]
        writes = fetch.writes
        assert writes is not None
        # The member GETs' bytes are in the arena for their reads: to the disk directly.
        direct = self.direct if writes.direct_fd is not None and on_chunk is not None \
            else None
        staged: Staged | None = None
        run = writes.run(get.start)  # [start, end, CRC-32C] of the bytes received
        at = get.pos  # the file offset of the next byte to come
        track = _GetWrites()
        try:
            if fetch.failed is not None:
                return 0
            source = self.sources.for_url(info.url)
            async with aclosing(source.stream(info, get.pos, get.stop)) as chunks:
                async for chunk in chunks:
                    if fetch.failed is not None:
                        return at - get.start  # the fill is over: its part file is closed
                    self.stats.shard_bytes += len(chunk)
                    if run is not None and run[1] < get.stop:
                        piece = chunk[: get.stop - run[1]]
                        run[2] = crc32c_value(piece, run[2])
                        run[1] += len(piece)
                    if on_chunk is not None:  # landed first: a direct write takes a while
                        on_chunk(chunk)
                    if direct is not None:
                        staged = await self._stage(direct, fetch, get, track, staged, chunk,
                                                   at)
                    else:
                        self.write(fetch, get, chunk)
                    at += len(chunk)
            if staged is not None:
                last, staged = staged, None
                assert direct is not None
                await self._write_staged(direct, fetch, get, track, last)
            if at < get.stop:
                raise SourceError(f"{info.url}: {get.stop - at} bytes of range "
                                  f"[{get.start}, {get.stop}) missing")
            return at - get.start
        except (SourceError, OSError) as exc:
            self._fill_failed(fetch, exc, direct_write=direct is not None and self.direct is direct)
            raise
        finally:
            if staged is not None:
                assert direct is not None
                direct.release(staged)
            track.received = True
            if not track.writing:  # else its last write's end: the GET is on its way till then
                with contextlib.suppress(ValueError):
                    fetch.gets.remove(get)

    def _fill_failed(self, fetch: Fetch, exc: Exception, *, direct_write: bool) -> None:
        """A fill GET failed, or one of its direct writes did: the fill fails (its part file
        is dropped, its readers read their members)."""
        if direct_write and isinstance(exc, OSError) and exc.errno == errno.EINVAL:
            # The file system took the O_DIRECT open but not the writes its statx alignment
            # allows: this fill fails, the next ones write as before.
            log.warning("direct writes to the cache failed (%s): through the page cache "
                        "from now on", exc)
            self.direct = None
        if fetch.failed is None:
            fetch.error = exc
            fetch.fail(exc)  # wakes _run_fill (which drops the part) and the readers

    async def _stage(self, direct: DirectWrites, fetch: Fetch, get: Get, track: _GetWrites,
                     staged: Staged | None, chunk: bytes, at: int) -> Staged | None:
        """Gather a fill GET's chunk (its first byte at file offset `at`) for a direct
        write; a full buffer is handed to the writer before the rest of the chunk is
        taken."""
        with memoryview(chunk) as view:
            view = view[: max(0, get.stop - at)]
            while view:
                if staged is None:
                    staged = direct.stage(at)
                taken = staged.add(view)
                view, at = view[taken:], at + taken
                if not staged.room:
                    full, staged = staged, None
                    await self._write_staged(direct, fetch, get, track, full)
        return staged

    async def _write_staged(self, direct: DirectWrites, fetch: Fetch, get: Get,
                            track: _GetWrites, staged: Staged) -> None:
        """Hand a GET's gathered bytes to the direct writer (which owns the buffer from
        now) and go on: they count as written once they are on the disk (a read waiting
        on them in the part file wakes only then, and the fill commits after them); a
        GET waits only while the writer has DirectWrites.pending_max bytes to write."""
        if fetch.failed is not None:  # (an earlier write of the fill failed meanwhile)
            direct.release(staged)
            return  # the fill is over: its part file is closed
        writes = fetch.writes
        assert writes is not None and writes.direct_fd is not None
        assert self.nursery is not None
        direct.start(self.nursery)
        at, n = staged.at, staged.size

        def on_done(error: OSError | None) -> None:
            track.writing -= 1
            if error is not None:
                self._fill_failed(fetch, error, direct_write=self.direct is direct)
            elif fetch.failed is None:
                writes.direct_bytes += n
                self.stats.fill_direct_bytes += n
                self.wrote(fetch, get, at, n)
            if track.received and not track.writing:
                with contextlib.suppress(ValueError):
                    fetch.gets.remove(get)

        track.writing += 1
        try:
            await direct.submit(staged, writes.direct_fd, fetch.part.fd, on_done)
        except BaseException:
            track.writing -= 1  # (not handed over: cancelled while the writer was full)
            direct.release(staged)
            raise


class _GetWrites:
    """A fill GET's direct writes: how many are on their way to the disk, and whether the
    GET has received all it will. It stays among its fetch's GETs (its bytes "on their way",
    Fetch.missing) until both are done."""

    __slots__ = ("received", "writing")

    def __init__(self) -> None:
        self.writing = 0
        self.received = False
