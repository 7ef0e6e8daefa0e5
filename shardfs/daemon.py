"""The mount lifecycle: index, mount, announce readiness, serve, unmount cleanly on signals."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyfuse3
import trio

from shardfs.cache import ShardCache
from shardfs.catalog import Catalog, open_catalog
from shardfs.fs import ShardFS
from shardfs.notify import sd_notify
from shardfs.progress import ProgressLine
from shardfs.reader import Reader, ReadPolicy
from shardfs.sources import Sources, SourceSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MountConfig:
    urls: list[str]
    mountpoint: str
    cache_dir: Path
    cache_size: int
    settings: SourceSettings = field(default_factory=SourceSettings)
    policy: ReadPolicy = field(default_factory=ReadPolicy)
    index_parallel: int = 8
    warm_while_indexing: bool = True
    allow_other: bool = False
    max_tasks: int = 256  # concurrent FUSE requests in flight (readers waiting on fetches)


def fuse_options(cfg: MountConfig) -> set[str]:
    options = {"fsname=shardfs", "subtype=shardfs", "ro", "default_permissions", "noatime"}
    if cfg.allow_other:
        options.add("allow_other")
    return options


def stats_snapshot(cfg: MountConfig, catalog: Catalog, cache: ShardCache, reader: Reader,
                   sources: Sources, started: float) -> dict:
    rs = reader.stats
    fetched = rs.shard_bytes + rs.member_bytes + catalog.indexed_bytes
    return {
        "mountpoint": cfg.mountpoint,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - started, 3),
        "shards": len(catalog.shards),
        "files": catalog.tree.count_files(),
        "dataset_bytes": reader.dataset_bytes,
        "shards_cached": cache.complete_count,
        "shards_fetching": len(reader.fetches),
        "cache_used_bytes": cache.used,
        "cache_budget_bytes": cache.budget,
        "evictions": cache.evictions,
        "bytes_fetched": fetched,
        "bytes_indexed": catalog.indexed_bytes,
        "bytes_served": rs.bytes_served,
        "amplification": round(fetched / rs.bytes_served, 4) if rs.bytes_served else None,
        "hit_ratio": round((rs.cache_hits + rs.frontier_hits) / rs.reads, 4) if rs.reads else None,
        "reader": asdict(rs),
        "source": asdict(sources.stats()),
    }


async def _probe_ready(mountpoint: str) -> None:
    """Returns once the kernel gets answers from us (the INIT handshake is done)."""
    await trio.to_thread.run_sync(os.stat, mountpoint)


async def serve(cfg: MountConfig, cache: ShardCache,
                on_ready: Callable[[str], None]) -> None:
    started = time.monotonic()
    sources = Sources(cfg.settings)
    try:
        progress = ProgressLine("indexing shards")
        catalog = await open_catalog(cfg.urls, sources, cache, progress=progress.update,
                                     parallel=cfg.index_parallel,
                                     warm=cfg.warm_while_indexing)
        progress.close()
        report = catalog.tree.report
        if report.shadowed:
            log.warning("%d paths appear in more than one shard; the later shard wins",
                        report.shadowed)
        if report.conflicts:
            log.warning("%d files are also used as directories by other members; "
                        "shown as directories", report.conflicts)
        reader = Reader(catalog, cache, sources, cfg.policy)

        def stats_json() -> bytes:
            snap = stats_snapshot(cfg, catalog, cache, reader, sources, started)
            return json.dumps(snap).encode()

        ops = ShardFS(catalog.tree, reader, [s.url for s in catalog.shards], uid=os.getuid(),
                      gid=os.getgid(), stats_json=stats_json)
        pyfuse3.init(ops, cfg.mountpoint, fuse_options(cfg))
        try:
            await _serve_mounted(cfg, catalog, reader, on_ready)
        finally:
            sd_notify("STOPPING=1")
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", cfg.mountpoint)
    finally:
        await sources.aclose()


async def _serve_mounted(cfg: MountConfig, catalog: Catalog, reader: Reader,
                         on_ready: Callable[[str], None]) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)

            async def fuse_main() -> None:
                await pyfuse3.main(max_tasks=cfg.max_tasks)
                log.info("the kernel ended the session (unmounted from outside)")
                nursery.cancel_scope.cancel()

            nursery.start_soon(fuse_main)
            await _probe_ready(cfg.mountpoint)
            summary = (f"{catalog.tree.count_files()} files from {len(catalog.shards)} shards "
                       f"mounted at {cfg.mountpoint}")
            log.info("ready: %s", summary)
            on_ready(summary)
            async for signum in signals:
                log.info("received %s: unmounting", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()
