"""Around the daemon's run(): mount-time warnings about the cache budget, and tidying a cache
dir a failed mount created. (Stop signals at every stage: `daemon/lifecycle.py`.)"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from shardfs.util.sizes import format_size

log = logging.getLogger("shardfs")


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
_LAYOUT_DIRS = ("shards", "index", "trees", "parts")
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
