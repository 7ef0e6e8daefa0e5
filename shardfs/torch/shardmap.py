"""Which shard of a shardfs mount holds each file of a dataset: `ShardMap`, read from the
mount's xattrs once and kept in a small on-disk cache keyed by the list of paths.

Only training code imports this module (it imports torch); the daemon never does. The mapping
only steers an order: a wrong or missing mapping costs speed, never correctness.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Subset

from shardfs.catalog.dirmap import PREFIX as DIRMAP_PREFIX
from shardfs.catalog.dirmap import decode_page

log = logging.getLogger(__name__)

SHARD_XATTR = "user.shardfs.shard"
DIR_PAGES = DIRMAP_PREFIX.decode()
STATS_XATTR = "user.shardfs.stats"
MAP_FORMAT = "shardfs-shardmap/1"
_PROBES = 16  # files probed before deciding the dataset is not on a mount at all
_SPOT_CHECKS = 32  # files re-checked against a cached mapping
_UNKNOWN = -1


@dataclass(frozen=True, slots=True)
class ShardMap:
    """The shard of every sample: `shards[shard_of[i]]` is the URL of sample i's shard.

    `shard_of[i] == -1` means sample i is not on a shardfs mount.
    """

    shards: tuple[str, ...]
    shard_of: torch.Tensor  # int64, one entry per sample

    def __len__(self) -> int:
        return int(self.shard_of.numel())

    @property
    def on_mount(self) -> int:
        """How many samples live on a shardfs mount."""
        return int((self.shard_of >= 0).sum())

    @classmethod
    def from_urls(cls, urls: Sequence[str | None]) -> ShardMap:
        """Build from one shard URL (or None: not on a mount) per sample."""
        shards = tuple(sorted({u for u in urls if u is not None}))
        ids = {url: i for i, url in enumerate(shards)}
        shard_of = torch.tensor([_UNKNOWN if u is None else ids[u] for u in urls],
                                dtype=torch.int64)
        return cls(shards, shard_of)

    def url(self, sample: int) -> str | None:
        k = int(self.shard_of[sample])
        return None if k < 0 else self.shards[k]


def sample_paths(dataset: Any) -> list[str]:
    """The file path of every sample of an ImageFolder-like dataset (`.samples`/`.imgs`),
    also through `torch.utils.data.Subset`."""
    if isinstance(dataset, Subset):
        base = sample_paths(dataset.dataset)
        return [base[i] for i in dataset.indices]
    for attr in ("samples", "imgs"):
        items = getattr(dataset, attr, None)
        if items is not None:
            return [os.fspath(it[0] if isinstance(it, tuple | list) else it) for it in items]
    raise TypeError(f"{type(dataset).__name__} exposes no file paths (.samples or .imgs); "
                    "pass shard_map=ShardMap.from_urls(...) instead")


def _shard_url(path: str) -> str | None:
    try:
        return os.getxattr(path, SHARD_XATTR).decode("utf-8", "surrogateescape")
    except OSError:  # ENODATA/ENOTSUP: not on a shardfs mount; ENOENT: gone. Order only.
        return None


def _probe(paths: Sequence[str]) -> bool:
    """Does any of a few evenly spaced files carry the xattr? Avoids 1 M failing calls."""
    n = len(paths)
    picks = {i * n // _PROBES for i in range(min(n, _PROBES))}
    return any(_shard_url(paths[i]) is not None for i in sorted(picks))


def _dir_map(directory: str) -> dict[bytes, str] | None:
    """A directory's {file name: shard URL} from its `user.shardfs.members.N` xattr pages, or
    None when the daemon has none (an older daemon, or not a shardfs directory)."""
    try:
        names = [n for n in os.listxattr(directory) if n.startswith(DIR_PAGES)]
        out: dict[bytes, str] = {}
        for name in names:
            out.update(decode_page(os.getxattr(directory, name)))
    except OSError:
        return None
    return out if names else None


def _read_urls(paths: Sequence[str]) -> list[str | None]:
    """A few xattr reads per directory (pages listing every file's shard); files those pages
    do not cover fall back to one getxattr each (~45-70 µs against the Python daemon)."""
    n = len(paths)
    began = last = time.monotonic()
    maps: dict[str, dict[bytes, str] | None] = {}
    urls: list[str | None] = []
    for i, path in enumerate(paths):
        directory, base = os.path.split(path)
        if directory not in maps:
            maps[directory] = _dir_map(directory)
        known = maps[directory]
        url = known.get(os.fsencode(base)) if known is not None else None
        urls.append(url if url is not None else _shard_url(path))
        if i & 0x3FFF == 0 and time.monotonic() - last > 10:
            last = time.monotonic()
            log.info("learning shards from the mount: %d/%d files (%.0f s)", i, n,
                     last - began)
    took = time.monotonic() - began
    if took > 5:
        log.info("learned the shards of %d files in %.1f s", n, took)
    return urls


def _default_cache_dir() -> Path:
    env = os.environ.get("SHARDFS_SAMPLER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardfs" / "samplers"


def _paths_key(paths: Sequence[str]) -> str:
    h = hashlib.sha256(MAP_FORMAT.encode())
    for p in paths:
        h.update(p.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()[:32]


def _encode_map(m: ShardMap) -> bytes:
    head = json.dumps({"format": MAP_FORMAT, "n": len(m), "shards": list(m.shards)})
    body = array("i", m.shard_of.to(torch.int32).tolist())
    if sys.byteorder != "little":
        body.byteswap()
    return head.encode() + b"\n" + body.tobytes()


def _decode_map(data: bytes) -> ShardMap | None:
    head, sep, body = data.partition(b"\n")
    try:
        meta = json.loads(head)
        ok = sep and meta["format"] == MAP_FORMAT and len(body) == 4 * int(meta["n"])
        shards = tuple(str(u) for u in meta["shards"])
    except (ValueError, KeyError, TypeError):  # damaged or foreign: rebuild
        return None
    if not ok:
        return None
    ids = array("i")
    ids.frombytes(body)
    if sys.byteorder != "little":
        ids.byteswap()
    shard_of = torch.tensor(ids, dtype=torch.int64)
    if shard_of.numel() and int(shard_of.max()) >= len(shards):
        return None
    return ShardMap(shards, shard_of)


def _still_valid(m: ShardMap, paths: Sequence[str]) -> bool:
    """Spot-check a cached mapping against the mount (a remount may hold other shards)."""
    n = len(paths)
    picks = random.Random(n).sample(range(n), min(n, _SPOT_CHECKS))
    return all(_shard_url(paths[i]) == m.url(i) for i in picks)


def _learn(paths: Sequence[str]) -> ShardMap:
    if not paths or not _probe(paths):
        return ShardMap((), torch.full((len(paths),), _UNKNOWN, dtype=torch.int64))
    return ShardMap.from_urls(_read_urls(paths))


def shard_map(paths: Sequence[str], *, cache: bool | str | os.PathLike[str] = True) -> ShardMap:
    """Which shard holds each file, from the mount's xattrs; cached on disk when `cache`.

    `cache=True` keeps the mapping under $SHARDFS_SAMPLER_CACHE (default
    ~/.cache/shardfs/samplers); a path puts it there; False reads the mount every time. The
    ranks of one node share the cache file: the first computes it under a lock, the others
    wait and load it, so the daemon answers each file once per node.
    """
    paths = [os.fspath(p) for p in paths]
    if cache is False or not paths:
        return _learn(paths)
    directory = _default_cache_dir() if cache is True else Path(cache)
    key = _paths_key(paths)
    target = directory / f"{key}.map"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / f"{key}.lock", "a+b")  # noqa: SIM115 (held across the build)
    except OSError as exc:
        log.warning("cannot use the shard map cache in %s (%s); not caching", directory, exc)
        return _learn(paths)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            cached = _decode_map(target.read_bytes())
            if cached is not None and len(cached) == len(paths) and _still_valid(cached, paths):
                return cached
        m = _learn(paths)
        if m.on_mount == 0:
            return m  # not on a mount: nothing worth keeping
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        try:
            tmp.write_bytes(_encode_map(m))
            os.replace(tmp, target)
        except OSError as exc:
            log.warning("cannot write the shard map cache %s: %s", target, exc)
            tmp.unlink(missing_ok=True)
        return m


def mount_stats(path: str | os.PathLike[str]) -> dict | None:
    """The counters of the shardfs mount holding `path` (its root's `user.shardfs.stats`
    xattr), or None when `path` is not on a shardfs mount."""
    root = os.path.realpath(path)
    while not os.path.ismount(root) and root != "/":
        root = os.path.dirname(root)
    try:
        return json.loads(os.getxattr(root, STATS_XATTR))
    except (OSError, ValueError):
        return None

