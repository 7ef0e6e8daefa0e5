"""Indexing zip shards and RecordIO files: the ranged reads around the pure parsers
(zip.py, recordio.py). Tar shards are scanned by catalog.py.

A zip is never downloaded to be indexed: its end records and central directory come by
ranged reads from the end, then the local headers (whose name and extra lengths say where
each member's data starts) by ranged reads coalesced over small gaps. A `.rec` with an
`.idx` beside it likewise reads only each record's first bytes; without one it is streamed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from shardfs.catalog import recordio
from shardfs.catalog import zip as zipfmt
from shardfs.catalog.shardindex import ShardIndex
from shardfs.sources import ShardInfo, Source, Sources
from shardfs.util.urls import path_of

log = logging.getLogger(__name__)

GAP = 64 << 10  # read through gaps up to this size rather than ask again
MAX_SPAN = 16 << 20  # but never more than this in one request
PARALLEL = 32  # ranged reads in flight per shard (the HTTP pool holds 32 connections)


class ArchiveError(ValueError):
    """A zip or RecordIO file that cannot be indexed; the message says why."""


def shard_format(url: str) -> str:
    """"zip", "recordio" or "tar" (plain or compressed), from the shard's name."""
    path = path_of(url).lower()  # an http(s) query is not part of the name
    if path.endswith(".zip"):
        return "zip"
    if path.endswith(".rec"):
        return "recordio"
    return "tar"


async def index_archive(kind: str, sources: Sources, info: ShardInfo,
                        on_bytes: Callable[[int], None]) -> ShardIndex:
    try:
        if kind == "zip":
            return await index_zip(sources.for_url(info.url), info, on_bytes)
        return await index_recordio(sources, info, on_bytes)
    except (zipfmt.ZipError, recordio.RecordIOError) as exc:
        raise ArchiveError(str(exc)) from None


async def _read(source: Source, info: ShardInfo, start: int, end: int,
                on_bytes: Callable[[int], None]) -> bytes:
    chunks = [c async for c in source.stream(info, start, end)]
    on_bytes(end - start)
    return b"".join(chunks)


async def read_spans(source: Source, info: ShardInfo, spans: list[tuple[int, int]],
                     on_bytes: Callable[[int], None],
                     known: tuple[int, bytes] = (0, b"")) -> list[bytes]:
    """The bytes of each [start, end) span (clipped to the shard), read by ranged requests
    that cover neighbouring spans together, several at once; spans within `known` (bytes
    read already, from an offset) are taken from it."""
    spans = [(min(s, info.size), min(e, info.size)) for s, e in spans]
    out: list[bytes] = [b""] * len(spans)
    have_at, have = known
    order = []
    for i, (start, end) in enumerate(spans):
        if have_at <= start and end <= have_at + len(have):
            out[i] = have[start - have_at : end - have_at]
        else:
            order.append(i)
    order.sort(key=lambda i: spans[i])
    groups: list[list] = []  # [start, end, span positions]
    for i in order:
        start, end = spans[i]
        g = groups[-1] if groups else None
        if g is not None and start - g[1] <= GAP and max(end, g[1]) - g[0] <= MAX_SPAN:
            g[1] = max(g[1], end)
            g[2].append(i)
        else:
            groups.append([start, end, [i]])
    limiter = trio.CapacityLimiter(PARALLEL)

    async def one(start: int, end: int, members: list[int]) -> None:
        async with limiter:
            data = await _read(source, info, start, end, on_bytes) if end > start else b""
        for i in members:
            s, e = spans[i]
            out[i] = data[s - start : e - start]

    async with trio.open_nursery() as nursery:
        for group in groups:
            nursery.start_soon(one, *group)
    return out


def _no_ranges(info: ShardInfo, what: str) -> None:
    if info.whole_only:
        raise zipfmt.ZipError(f"{what} needs a server that answers Range requests "
                              "(this one sends whole objects)")


async def index_zip(source: Source, info: ShardInfo,
                    on_bytes: Callable[[int], None]) -> ShardIndex:
    _no_ranges(info, "indexing a zip")
    size = info.size
    tail_start = max(0, size - zipfmt.TAIL)
    tail = await _read(source, info, tail_start, size, on_bytes)
    where = zipfmt.locate_directory(tail, tail_start, size)
    if where.zip64_at is not None:
        at = where.zip64_at
        record = tail[at - tail_start : at - tail_start + 56] if at >= tail_start else \
            await _read(source, info, at, min(size, at + 56), on_bytes)
        where = zipfmt.zip64_directory(record, at, size)
    if where.start >= tail_start:
        directory = tail[where.start - tail_start : where.start - tail_start + where.size]
    else:
        directory = await _read(source, info, where.start, where.start + where.size, on_bytes)
    entries = zipfmt.parse_directory(directory, where)
    wanted = [i for i, e in enumerate(entries) if not e.is_dir and e.path is not None]
    heads = await read_spans(source, info, [
        (entries[i].header, entries[i].header + zipfmt.head_span(entries[i])) for i in wanted
    ], on_bytes, (tail_start, tail))
    starts: list[int | None] = [None] * len(entries)
    for i, head in zip(wanted, heads, strict=True):
        starts[i] = zipfmt.data_start(entries[i], head)
    full_heads: list[bytes] = [b""] * len(entries)
    for i, head in zip(wanted, heads, strict=True):
        full_heads[i] = head
    listing = zipfmt.members(entries, starts, where, full_heads)
    index = ShardIndex(size=size)
    index.extend(listing.members)
    index.skipped = dict(listing.skipped)
    index.notes = dict(listing.notes)
    return index


async def index_recordio(sources: Sources, info: ShardInfo,
                         on_bytes: Callable[[int], None]) -> ShardIndex:
    source = sources.for_url(info.url)
    idx_url = recordio.idx_url_of(info.url)
    idx = await sources.for_url(idx_url).fetch_optional(idx_url)
    if idx is None:
        log.warning("%s: no %s beside it; scanning the whole file for its records",
                    info.url, idx_url)
        scanner = recordio.RecordScanner()
        async for chunk in source.stream(info, 0, info.size):
            scanner.feed(chunk)
            on_bytes(len(chunk))
        scanner.finish()
        records = scanner.records
    else:
        _no_ranges(info, "reading a RecordIO file by its .idx")
        records = await _records_by_idx(source, info, recordio.parse_idx(idx), on_bytes)
    listing = recordio.members(records)
    index = ShardIndex(size=info.size)
    index.extend(listing.members)
    index.skipped = dict(listing.skipped)
    index.notes = dict(listing.notes)
    return index


async def _records_by_idx(source: Source, info: ShardInfo, keys: list[tuple[bytes, int]],
                          on_bytes: Callable[[int], None]) -> list[recordio.Record]:
    size = info.size
    for key, offset in keys:
        if offset + recordio.CHUNK_HEADER > size:
            raise recordio.RecordIOError(f".idx key {key!r}: offset {offset} is past the end")
    want = recordio.CHUNK_HEADER + recordio.HEAD
    heads = await read_spans(source, info, [(o, o + want) for _, o in keys], on_bytes)
    records = []
    for (key, offset), head in zip(keys, heads, strict=True):
        first = recordio.chunk_at(head, offset)
        if first.cflag not in (0, 1):
            raise recordio.RecordIOError(f".idx key {key!r}: offset {offset} is inside a "
                                         "split record, not at its start")
        chunks = [first]
        while chunks[-1].cflag not in (0, 3):  # a split record (rare): follow its chunks
            at = chunks[-1].next
            if at + recordio.CHUNK_HEADER > size:
                raise recordio.RecordIOError(f"split record {key!r} runs past the end")
            nxt = recordio.chunk_at(await _read(source, info, at, at + 8, on_bytes), at)
            if nxt.cflag not in (2, 3):
                raise recordio.RecordIOError(f"split record {key!r} is broken at byte {at}")
            chunks.append(nxt)
        end = chunks[-1].at + recordio.CHUNK_HEADER + chunks[-1].length
        if end > size:
            raise recordio.RecordIOError(f"record {key!r} runs past the end of the file")
        body = head[recordio.CHUNK_HEADER : recordio.CHUNK_HEADER + first.length]
        records.append(recordio.Record(key, chunks, body[: recordio.HEAD]))
    return records
