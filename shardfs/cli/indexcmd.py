"""`shardfs index SOURCE... -o DIR`: write index files to publish next to the shards."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from urllib.parse import unquote_to_bytes, urlsplit

import trio

from shardfs.catalog.archives import ArchiveError, index_archive, shard_format
from shardfs.catalog.catalog import CatalogError, scan_stream, stat_all
from shardfs.catalog.resolve import resolve_sources
from shardfs.catalog.shardindex import INDEX_SUFFIX, encode_index
from shardfs.catalog.tar import TarError
from shardfs.sources import ShardInfo, SourceError, Sources, SourceSettings
from shardfs.util.aioutil import first_error
from shardfs.util.progress import ProgressLine
from shardfs.util.sizes import format_size

log = logging.getLogger(__name__)


def index_name(url: str) -> str:
    """`.../train-000003.tar` -> `train-000003.tar.shardfs.idx` (bytes-exact: the file the
    catalog looks for beside the shard, also where its name is not UTF-8)."""
    return os.fsdecode(unquote_to_bytes(urlsplit(url).path.rsplit("/", 1)[-1])) + INDEX_SUFFIX


async def _write_all(specs: list[str], out: Path, parallel: int) -> int:
    sources = Sources(SourceSettings())
    progress = ProgressLine("indexing shards")
    try:
        infos = await stat_all(await resolve_sources(specs, sources), sources)
        names = [index_name(info.url) for info in infos]
        if len(set(names)) != len(names):
            raise CatalogError("two shards have the same file name; index them separately")
        limiter = trio.CapacityLimiter(parallel)
        done = streamed = 0

        def count(n: int) -> None:
            nonlocal streamed
            streamed += n
            progress.update("index", done, len(infos), f"{format_size(streamed)} streamed")

        async def one(info: ShardInfo, name: str) -> None:
            nonlocal done
            async with limiter:
                kind = shard_format(info.url)
                try:
                    if kind == "tar":
                        index = await scan_stream(sources.for_url(info.url), info, None, count)
                    else:
                        index = await index_archive(kind, sources, info, count)
                except (TarError, ArchiveError) as exc:
                    raise CatalogError(f"{info.url}: not a usable {kind} shard: {exc}") \
                        from None
            await trio.Path(out / name).write_bytes(encode_index(index))
            done += 1
            progress.update("index", done, len(infos))

        with first_error():
            async with trio.open_nursery() as nursery:
                for info, name in zip(infos, names, strict=True):
                    nursery.start_soon(one, info, name)
        return len(infos)
    finally:
        progress.close()
        await sources.aclose()


def write_indexes(specs: list[str], out: Path, *, parallel: int = 8) -> int:
    try:
        out.mkdir(parents=True, exist_ok=True)
        count = trio.run(_write_all, specs, out, parallel)
    except (CatalogError, SourceError, OSError) as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {count} index files to {out}; publish each next to its shard")
    return 0
