"""Around the daemon's serve(): stop signals before and after the mount is ready, mount-time
warnings about the cache budget, and tidying a cache dir a failed mount created."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import trio

from shardfs.daemon.lifecycle import MountConfig, serve
from shardfs.read.cache import ShardCache
from shardfs.util.sizes import format_size

log = logging.getLogger("shardfs")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """A stop signal arrived before the mount was ready."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


async def serve_until_signalled(cfg: MountConfig, cache: ShardCache,
                                on_ready: Callable[[str], None]) -> None:
    """serve(), stoppable by SIGINT/SIGTERM/SIGHUP at every stage.

    Before the mount is ready (resolving, indexing, building the tree) a signal cancels the
    work: fetches in flight are aborted, their partial files dropped, and Interrupted is
    raised. Once mounted, serve() itself unmounts on SIGINT/SIGTERM; a SIGHUP (the terminal
    of a `-f` mount closed) unmounts the same way."""
    ready = False

    def ready_now(summary: str) -> None:
        nonlocal ready
        ready = True
        on_ready(summary)

    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    if not ready:
                        raise Interrupted(signum)
                    log.info("received %s: unmounting", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await serve(cfg, cache, ready_now)
            nursery.cancel_scope.cancel()


def check_cache_budget(cache_dir: Path, budget: int) -> None:
    """Warn when the budget is larger than the disk under the cache can hold."""
    try:
        free = shutil.disk_usage(cache_dir).free
    except OSError:
        return
    shards = cache_dir / "shards"
    held = sum(e.stat().st_size for e in os.scandir(shards) if e.is_file()) \
        if shards.is_dir() else 0
    if budget > free + held:
        log.warning("--cache-size %s is more than the disk under %s can hold (%s free, %s "
                    "already cached): the disk will fill up before the budget does; shardfs "
                    "then lowers the budget to what the disk holds", format_size(budget),
                    cache_dir, format_size(free), format_size(held))


# What ShardCache.open() creates in an empty cache dir; a cache dir holding nothing else
# (no shard, index or tree) has no value and is removed when the mount that made it fails.
_LAYOUT_DIRS = ("shards", "index", "trees")
_LAYOUT_FILES = ("lock", "shardfs.log")


def remove_if_unused(cache_dir: Path) -> None:
    try:
        entries = set(os.listdir(cache_dir))
        if not entries <= {*_LAYOUT_DIRS, *_LAYOUT_FILES}:
            return
        if any(os.listdir(cache_dir / d) for d in _LAYOUT_DIRS if d in entries):
            return
        for name in entries:
            path = cache_dir / name
            if name in _LAYOUT_DIRS:
                path.rmdir()
            else:
                path.unlink()
        cache_dir.rmdir()
    except OSError as exc:  # someone else is using it now: leave it
        log.debug("not removing cache dir %s: %s", cache_dir, exc)
