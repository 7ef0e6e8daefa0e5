"""The index of every shard's members: found, built or reused before the mount appears.

For each shard, in order of preference:
  1. the cached index in the cache dir, keyed by the shard's identity (URL without a
     signature + size + ETag; ShardInfo.identity);
  2. a published index file next to the shard (`<shard>.shardfs.idx`), used when it is valid
     for that shard (its size, its own checksum);
  3. a scan of the shard: local files are walked header to header with seeks; remote shards
     are streamed once (in parallel), and the streamed bytes also warm the cache when they fit.
The merged tree is built in a child process (so the daemon never holds the per-member build
state) and cached too, so a remount of the same shards needs only one request per shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import trio

from shardfs.cache.shardcache import DISK_FULL, PartFile, ShardCache, pwrite_all, shard_key
from shardfs.catalog.archives import ArchiveError, index_archive, shard_format
from shardfs.catalog.codecs import CodecError, Decompressor, codec_for, decompressor
from shardfs.catalog.shardindex import (
    INDEX_SUFFIX,
    IndexFormatError,
    ShardIndex,
    decode_index,
    encode_index,
)
from shardfs.catalog.tar import TarError, TarScanner
from shardfs.catalog.tree import TREE_FORMAT, Tree
from shardfs.sources import ShardInfo, Source, SourceError, Sources
from shardfs.sources.file import file_path
from shardfs.util.aioutil import first_error
from shardfs.util.checksum import ShardCheck, ShardSums, shard_check, valid_crc32c
from shardfs.util.sizes import format_size
from shardfs.util.urls import beside

log = logging.getLogger(__name__)

Progress = Callable[..., None]  # (phase, done, total[, detail])
_LOCAL_READ = 256 * 1024


class CatalogError(Exception):
    """A shard could not be listed; the message names it and says why."""


@dataclass(slots=True)
class Catalog:
    shards: list[ShardInfo]
    keys: list[str]  # cache key of each shard
    sha256: list[str | None]  # whole-shard digest when known (verifies complete fetches)
    tree: Tree
    codecs: list[str | None] = field(default_factory=list)  # compression of each shard
    skipped: dict[str, int] = field(default_factory=dict)  # members not exposed, by reason
    data_sizes: list[int] = field(default_factory=list)  # plain tar bytes (what is cached)
    # Shards with no member reads: every read waits for the whole-shard fetch (compressed
    # shards, and shards on servers that ignore Range requests).
    whole_only: list[bool] = field(default_factory=list)
    indexed_bytes: int = 0  # bytes streamed to build indexes in this run
    warmed: int = 0  # shards cached while indexing
    crc32c: list[str | None] = field(default_factory=list)  # whole-shard CRC-32C when known

    def cached_sizes(self) -> list[int]:
        """Bytes each shard takes in the cache: its plain tar (a compressed shard is
        decompressed there). Catalogs made by hand may leave data_sizes empty."""
        return self.data_sizes or [info.size for info in self.shards]

    def shard_codecs(self) -> list[str | None]:
        """Each shard's compression (None: plain)."""
        return self.codecs or [None] * len(self.shards)

    def check(self, shard: int, verify: str = "auto") -> ShardCheck | None:
        """What a complete fetch of `shard` is checked against (util/checksum.py)."""
        crc32c = self.crc32c[shard] if self.crc32c else None
        return shard_check(self.sha256[shard], crc32c, verify)


def local_path(url: str) -> str | None:
    """The path a file:// URL names (bytes-exact: a name that is not UTF-8 too), else None."""
    return file_path(url) if urlsplit(url).scheme.lower() == "file" else None


def scan_local_file(path: str) -> ShardIndex:
    """Index a local tar by walking its headers, seeking over member data."""
    codec = codec_for(path)
    if codec is not None:
        return _scan_local_compressed(path, codec)
    size = os.stat(path).st_size
    index = ShardIndex(size=size)
    scanner = TarScanner()
    with open(path, "rb", buffering=0) as f:
        while not scanner.done:
            # Never seek past EOF: skip() trusts us, and a member whose size runs past the
            # end must be reported as truncated, not indexed with data beyond the shard
            # (the tree build then died on the index; found by the hostile corpus, #7).
            skip = min(scanner.skippable, size - f.tell())
            if skip > _LOCAL_READ:
                f.seek(skip, os.SEEK_CUR)
                scanner.skip(skip)
                continue
            chunk = f.read(_LOCAL_READ)
            if not chunk:
                break
            index.extend(scanner.feed(chunk))
    scanner.finish()
    index.skipped = dict(scanner.skipped)
    index.notes = dict(scanner.notes)
    return index


def _scan_local_compressed(path: str, codec: str) -> ShardIndex:
    """A compressed local shard cannot be seeked through: decompress it all once."""
    index = ShardIndex(size=os.stat(path).st_size, compression=codec)
    scanner = TarScanner()
    plain = decompressor(codec)
    digest = ShardSums()
    tar_size = 0

    def take(data: bytes) -> None:
        nonlocal tar_size
        tar_size += len(data)
        if not scanner.done:
            index.extend(scanner.feed(data))

    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_LOCAL_READ):
            digest.update(chunk)
            plain.feed_into(chunk, take)
    take(plain.finish())
    scanner.finish()
    (index.sha256, index.crc32c), index.tar_size = digest.hexdigests(), tar_size
    index.skipped = dict(scanner.skipped)
    index.notes = _notes(scanner, plain, path)
    return index


def _notes(scanner: TarScanner, plain: Decompressor, name: str) -> dict[str, int]:
    """The scanner's fix-ups, plus trailing garbage after the compressed stream (logged)."""
    notes = dict(scanner.notes)
    if plain.trailing_garbage:
        log.warning("%s: %d bytes after the end of the compressed data ignored (as gzip and "
                    "GNU tar do)", name, plain.trailing_garbage)
        notes["compressed-trailing-garbage"] = 1
    return notes


async def scan_stream(
    source: Source, info: ShardInfo, warm_fd: int | None, on_bytes: Callable[[int], None],
    on_warm_error: Callable[[OSError], None] | None = None,
) -> ShardIndex:
    """Index a remote tar by streaming it once; optionally write the (plain tar) bytes to
    `warm_fd`. Compressed shards are decompressed on the way. If writing to `warm_fd` fails
    (e.g. the disk is full) and `on_warm_error` is given, it is called and the scan goes on
    without warming; otherwise the error propagates."""
    codec = codec_for(info.url)
    index = ShardIndex(size=info.size, compression=codec)
    plain = decompressor(codec) if codec else None
    scanner = TarScanner()
    digest = ShardSums()
    pos = 0

    def take(data: bytes) -> None:
        nonlocal pos, warm_fd
        if not scanner.done:
            index.extend(scanner.feed(data))
        if warm_fd is not None:
            try:
                pwrite_all(warm_fd, data, pos)  # all of it: a short write leaves a hole
            except OSError as exc:
                if on_warm_error is None:
                    raise
                warm_fd = None  # indexing goes on; the caller drops the warm copy
                on_warm_error(exc)
        pos += len(data)

    async for chunk in source.stream(info, 0, info.size):
        digest.update(chunk)
        if plain is not None:
            plain.feed_into(chunk, take)  # in bounded pieces: see Decompressor.feed_into
        else:
            take(chunk)
        on_bytes(len(chunk))
    if plain is not None:
        take(plain.finish())
        index.tar_size = pos
    scanner.finish()
    index.sha256, index.crc32c = digest.hexdigests()
    index.skipped = dict(scanner.skipped)
    index.notes = _notes(scanner, plain, info.url) if plain else dict(scanner.notes)
    return index


class _Indexer:
    def __init__(self, sources: Sources, cache: ShardCache | None, progress: Progress | None,
                 warm: bool) -> None:
        self.sources = sources
        self.cache = cache
        self.progress = progress
        self.warm = warm
        self.warming = 0  # scans writing a warm copy right now
        self.streamed = 0
        self.warmed = 0
        self.done = 0
        self.total = 0

    def _report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    def _count(self, n: int) -> None:
        self.streamed += n
        if self.progress is not None:  # bytes move long before the first shard is done
            self.progress("index", self.done, self.total,
                          f"{format_size(self.streamed)} streamed")

    async def index(self, info: ShardInfo, key: str) -> ShardIndex:
        """The index of one shard: cached, published or scanned, and cached afterwards."""
        cached = self.cache.index_path(key) if self.cache else None
        if cached is not None and cached.exists():
            try:
                data = await trio.Path(cached).read_bytes()
                return decode_index(data, expect_size=info.size)
            except IndexFormatError as exc:
                log.warning("ignoring damaged cached index %s: %s", cached, exc)
        index = await self._published(info)
        if index is None:
            index = await self._scan(info, key)
        if cached is not None:
            await self._write_index(info, cached, encode_index(index))
        return index

    async def _write_index(self, info: ShardInfo, path: Path, data: bytes) -> None:
        """Indexes come before warm copies of shards (issue #7): on a full disk, stop warming,
        let the warm copies in flight fail and free their room, then evict cached shards
        until the index fits. A disk too full even then is one clear error."""
        assert self.cache is not None
        while True:
            try:
                await trio.to_thread.run_sync(_write_atomic, path, data)
                return
            except OSError as exc:
                if exc.errno not in DISK_FULL or not await self._make_room():
                    raise CatalogError(f"cannot write the index of {info.url} to the cache "
                                       f"dir: {exc.strerror}") from None

    async def _make_room(self) -> bool:
        assert self.cache is not None
        if self.warm:
            log.warning("cache disk full while indexing: no more warm copies in this run")
            self.warm = False
        if self.warming:
            await trio.sleep(0.05)  # their next write fails on the full disk and frees it
            return True
        return self.cache.evict_lru()

    async def _published(self, info: ShardInfo) -> ShardIndex | None:
        url = beside(info.url, INDEX_SUFFIX)
        data = await self.sources.for_url(url).fetch_optional(url)
        if data is None:
            return None
        try:
            return decode_index(data, expect_size=info.size)
        except IndexFormatError as exc:
            log.warning("ignoring index %s: %s; scanning the shard instead", url, exc)
            return None

    async def _scan(self, info: ShardInfo, key: str) -> ShardIndex:
        kind = shard_format(info.url)
        if kind != "tar":  # zip, RecordIO: ranged reads, wherever the shard is
            try:
                return await index_archive(kind, self.sources, info, self._count)
            except ArchiveError as exc:
                raise CatalogError(f"{info.url}: not a usable {kind} shard: {exc}") from None
        path = local_path(info.url)
        try:
            if path is not None:
                return await trio.to_thread.run_sync(scan_local_file, path)
            return await self._scan_remote(info, key)
        except (TarError, CodecError) as exc:
            raise CatalogError(f"{info.url}: not a usable tar shard: {exc}") from None

    async def _scan_remote(self, info: ShardInfo, key: str) -> ShardIndex:
        cache = self.cache
        part = None
        compressed = codec_for(info.url) is not None
        # Warm the cache with the bytes we must stream anyway, but only into free room. The
        # plain size of a compressed shard is known only at the end: reserve room then.
        if cache is not None and self.warm and (
                compressed or cache.reserve(key, info.size, evict=False)):
            try:
                # No record: an indexing scan is not continued by a later start (it
                # writes the whole shard from byte 0, over a part kept from one, too).
                part = cache.begin(key, 0 if compressed else info.size, record=False)
            except OSError as exc:
                self._warm_failed(info, key, None, exc)
        # Warming is optional: a full disk (issue #7) drops the warm copy, never the mount.
        warm_errors: list[OSError] = []
        # Counted until the warm copy is committed or dropped: while its fdatasync runs it is
        # neither a scan nor an evictable shard, and `_make_room` must wait for it.
        self.warming += part is not None
        try:
            try:
                index = await scan_stream(self.sources.for_url(info.url), info,
                                          part.fd if part else None, self._count,
                                          warm_errors.append)
            except BaseException:
                if cache is not None and part is not None:
                    cache.abort(part, key)
                raise
            if cache is not None and part is not None:
                await self._keep_warm_copy(info, key, part, index, compressed, warm_errors)
        finally:
            self.warming -= part is not None
        return index

    async def _keep_warm_copy(self, info: ShardInfo, key: str, part: PartFile,
                              index: ShardIndex, compressed: bool,
                              warm_errors: list[OSError]) -> None:
        assert self.cache is not None
        if warm_errors:
            self._warm_failed(info, key, part, warm_errors[0])
            return
        if compressed and not self.cache.reserve(key, index.data_size, evict=False):
            self.cache.abort(part, key)
            return
        part.size = index.data_size
        try:
            await self.cache.commit(part)
        except OSError as exc:  # fdatasync reports a full disk late on some filesystems
            self._warm_failed(info, key, part, exc)
            return
        self.warmed += 1

    def _warm_failed(self, info: ShardInfo, key: str, part: PartFile | None,
                     exc: OSError) -> None:
        assert self.cache is not None
        self.cache.abort(part, key)
        log.warning("not keeping %s in the cache while indexing: %s", info.url, exc)
        if exc.errno in DISK_FULL:
            self.warm = False  # the indexes still to be written need the room more
            self.cache.disk_full()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written file
        raise


async def stat_all(urls: list[str], sources: Sources, parallel: int = 32) -> list[ShardInfo]:
    """Size and validators of every shard, in parallel; one error message for all failures."""
    infos: list[ShardInfo | None] = [None] * len(urls)
    errors: dict[int, str] = {}  # by shard position: the message names the first in order
    limiter = trio.CapacityLimiter(parallel)

    async def one(i: int, url: str) -> None:
        async with limiter:
            try:
                infos[i] = await sources.for_url(url).stat(url)
            except SourceError as exc:
                errors[i] = str(exc)

    with first_error():
        async with trio.open_nursery() as nursery:
            for i, url in enumerate(urls):
                nursery.start_soon(one, i, url)
    if errors:
        more = f" (and {len(errors) - 1} more of {len(urls)} shards failed)" \
            if len(errors) > 1 else ""
        raise CatalogError(errors[min(errors)] + more)
    return [i for i in infos if i is not None]


async def index_all(infos: list[ShardInfo], sources: Sources, cache: ShardCache | None, *,
                    progress: Progress | None = None, parallel: int = 8, warm: bool = True,
                    on_index: Callable[[int, ShardIndex], None] | None = None) -> _Indexer:
    """Make sure every shard has an index (calling on_index with each), in parallel."""
    indexer = _Indexer(sources, cache, progress, warm)
    indexer.total = len(infos)
    limiter = trio.CapacityLimiter(parallel)
    keys = [shard_key(info.identity) for info in infos]

    async def one(i: int) -> None:
        async with limiter:
            index = await indexer.index(infos[i], keys[i])
        if on_index is not None:
            on_index(i, index)
        indexer.done += 1
        indexer._report("index", indexer.done, len(infos))

    with first_error():
        async with trio.open_nursery() as nursery:
            for i in range(len(infos)):
                nursery.start_soon(one, i)
    return indexer


def tree_key(infos: list[ShardInfo]) -> str:
    text = TREE_FORMAT + "\n" + "\n".join(info.identity for info in infos)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:40]


async def _build_tree_file(index_paths: list[Path], out: Path) -> dict:
    """Run the tree build in a child process; its peak memory never becomes the daemon's."""
    with tempfile.NamedTemporaryFile("w", suffix=".list", dir=out.parent, delete=False) as f:
        f.write("\n".join(str(p) for p in index_paths))
        list_file = f.name
    try:
        result = await trio.run_process(
            [sys.executable, "-m", "shardfs.catalog.treebuild", list_file, str(out)],
            capture_stdout=True, capture_stderr=True, check=False,
        )
    finally:
        os.unlink(list_file)
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace")
        cls = _TreeDiskFull if "[Errno 28]" in stderr or "[Errno 122]" in stderr \
            else CatalogError  # ENOSPC / EDQUOT, as the child's traceback names them
        raise cls(f"building the tree failed: {stderr}")
    return json.loads(result.stdout)


class _TreeDiskFull(CatalogError):
    """The tree build ran out of disk space in the cache dir."""


async def _build_tree_with_room(cache: ShardCache, index_paths: list[Path], out: Path) -> dict:
    """Build the tree; on a full disk, evict cached shards (warmed while indexing) until it
    fits: the tree, like the indexes, comes before shard data (issue #7)."""
    while True:
        try:
            return await _build_tree_file(index_paths, out)
        except OSError as exc:  # writing the list file
            if exc.errno not in DISK_FULL or not cache.evict_lru():
                raise CatalogError(f"cannot write the tree to the cache dir: {exc.strerror}") \
                    from None
        except _TreeDiskFull:
            if not cache.evict_lru():
                raise


def _read_header(path: Path) -> dict:
    """The JSON header line of an index file ({} when it is unreadable)."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
    except (OSError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def check_budget(infos: list[ShardInfo], sizes: list[int], whole_only: list[bool],
                 budget: int) -> None:
    """Say once, with numbers, what the cache budget means for these shards."""
    no_range = [info for info in infos if info.whole_only]
    if no_range:
        hosts = sorted({urlsplit(info.url).netloc for info in no_range})
        log.warning("%d shards on %s: the server ignores Range requests, so they are read in "
                    "whole-shard-only mode: a read waits for its shard's sequential download "
                    "(no member reads), and the cache must hold the shards in use",
                    len(no_range), ", ".join(hosts))
    largest = max(sizes, default=0)
    if largest <= budget:
        return
    name = infos[sizes.index(largest)].url
    whole = [size for size, only in zip(sizes, whole_only, strict=True) if only and size > budget]
    if whole:
        log.warning("--cache-size %s is smaller than %d shards that can only be read whole "
                    "(largest %s: %s): reads of them fail with EIO; give the cache at least "
                    "the size of the shards in use", format_size(budget), len(whole),
                    format_size(largest), name)
    else:
        log.warning("--cache-size %s is smaller than the largest shard (%s: %s): shards that "
                    "do not fit are never cached whole, and every read of them becomes a "
                    "separate request for that file; give the cache room for a few shards",
                    format_size(budget), format_size(largest), name)


async def open_catalog(urls: list[str], sources: Sources, cache: ShardCache, *,
                       progress: Progress | None = None, parallel: int = 8,
                       warm: bool = True, infos: list[ShardInfo] | None = None) -> Catalog:
    """Everything the mount needs before it appears: shard identities and the merged tree.
    `infos`: the identities to use instead of asking the sources (a takeover must serve the
    tree the kernel has seen)."""
    if infos is None:
        infos = await stat_all(urls, sources)
    keys = [shard_key(info.identity) for info in infos]
    tree_path = cache.tree_path(tree_key(infos))
    indexer = None
    if not tree_path.exists():
        indexer = await index_all(infos, sources, cache, progress=progress, parallel=parallel,
                                  warm=warm)
        report = await _build_tree_with_room(cache, [cache.index_path(k) for k in keys],
                                             tree_path)
        log.info("tree built: %s", report)
    try:
        tree = await trio.to_thread.run_sync(Tree.load, tree_path)
    except (OSError, ValueError, EOFError) as exc:
        tree_path.unlink(missing_ok=True)
        raise CatalogError(f"cached tree {tree_path} is damaged ({exc}); mount again") from None
    headers = [_read_header(cache.index_path(k)) for k in keys]
    codecs = [codec_for(info.url) for info in infos]
    sizes = [h.get("tar_size") if c else info.size
             for h, c, info in zip(headers, codecs, infos, strict=True)]
    missing = [infos[i].url for i, size in enumerate(sizes) if not isinstance(size, int)]
    if missing:  # the tree is cached but an index it came from is gone: rebuild next time
        tree_path.unlink(missing_ok=True)
        raise CatalogError(f"index of compressed shard {missing[0]} is missing; mount again")
    whole_only = [c is not None or info.whole_only for c, info in zip(codecs, infos, strict=True)]
    check_budget(infos, sizes, whole_only, cache.budget)
    skipped: dict[str, int] = {}
    notes: dict[str, int] = {}
    for h in headers:
        for reason, count in (h.get("skipped") or {}).items():
            skipped[reason] = skipped.get(reason, 0) + int(count)
        for kind, count in (h.get("notes") or {}).items():
            notes[kind] = notes.get(kind, 0) + int(count)
    if notes:
        log.info("member names or headers fixed up as GNU tar does: %s", notes)
    return Catalog(shards=infos, keys=keys, sha256=[h.get("sha256") for h in headers],
                   crc32c=[c if valid_crc32c(c := h.get("crc32c")) else None for h in headers],
                   skipped=skipped,
                   tree=tree, codecs=codecs, data_sizes=sizes, whole_only=whole_only,
                   indexed_bytes=indexer.streamed if indexer else 0,
                   warmed=indexer.warmed if indexer else 0)
