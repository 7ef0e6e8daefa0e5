"""Shard-aware samplers: epoch orders that read a shardfs mount shard by shard.

Only training code imports this module (it imports torch); the daemon never does.

The stock RandomSampler and DistributedSampler read files in uniformly random order, so every
shard is in use all the time. When the dataset is larger than the mount's cache, the daemon
cannot cache whole shards without thrashing and falls back to fetching single members (one
request per file); in a DDP job every node touches, and so fetches, every shard. The samplers
here shuffle the shards, then the samples within a sliding window of a few shards, so a mount
streams each shard once per epoch and each node only the shards dealt to it.

Which shard holds a file is read from the mount (the `user.shardfs.shard` xattr of each file)
once, then kept in a small on-disk cache keyed by the list of paths, so later runs start at
once. The mapping only steers the order: a wrong or missing mapping costs speed, never
correctness (every epoch is still a permutation of all sample indices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import heapq
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Sampler, Subset

from shardfs.catalog.dirmap import PREFIX as DIRMAP_PREFIX
from shardfs.catalog.dirmap import decode_page
from shardfs.torch.announce import SHARDS_AHEAD, announce_shards
from shardfs.torch.lookahead import Lookahead

__all__ = [
    "DistributedShardSampler",
    "Lookahead",
    "ShardAwareSampler",
    "ShardMap",
    "fitting_window",
    "mount_stats",
    "sample_paths",
    "shard_map",
]

log = logging.getLogger(__name__)

SHARD_XATTR = "user.shardfs.shard"
DIR_PAGES = DIRMAP_PREFIX.decode()
STATS_XATTR = "user.shardfs.stats"
WORKING_SET_READS = 512  # the daemon's window when its stats do not say (older daemons)
MAP_FORMAT = "shardfs-shardmap/1"
DEFAULT_WINDOW = 4  # shards in use at once: enough mixing, a small cache working set
SPREAD_ROOM = 0.75  # of the cache, for the working set of a window (see fitting_window)
_PROBES = 16  # files probed before deciding the dataset is not on a mount at all
_SPOT_CHECKS = 32  # files re-checked against a cached mapping
_UNKNOWN = -1


# -- which shard holds each file --------------------------------------------------------------


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


# -- epoch orders -----------------------------------------------------------------------------


def _groups(m: ShardMap) -> tuple[torch.Tensor, int]:
    """Group id of every sample: its shard, or a group of its own when it is not on a mount
    (such samples need no locality and get spread uniformly)."""
    gid = m.shard_of.clone()
    unknown = gid < 0
    n_unknown = int(unknown.sum())
    if n_unknown:
        gid[unknown] = torch.arange(len(m.shards), len(m.shards) + n_unknown)
    return gid, len(m.shards) + n_unknown


def _interleave(part: torch.Tensor, gid: torch.Tensor, window: int,
                g: torch.Generator) -> torch.Tensor:
    """Shuffle `part` (samples grouped in runs of one shard) within a sliding window of
    `window` shards.

    Each run gets a time interval as long as its sample count on one of `window` lanes; a lane
    takes the next run when its current one ends, and lane starts are staggered by a fraction
    of a run so that runs end (and the next shards open) one at a time. Each sample lands at
    a uniformly random time within its run's interval. So at any point of the order at most
    `window` shards are open, and the mount fetches about one new shard at a time instead of
    `window` at once with twice as many shards in use at a block boundary.
    """
    n = part.numel()
    pg = gid[part]
    change = torch.cat([torch.ones(1, dtype=torch.bool), pg[1:] != pg[:-1]])
    n_runs = int(change.sum())
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if n_runs == n:  # every sample its own group (not on a mount): plain shuffle
        return part[torch.argsort(u)]
    run_of = torch.cumsum(change.to(torch.int64), 0) - 1
    lengths = torch.bincount(run_of, minlength=n_runs).tolist()
    lanes = min(window, n_runs)
    stagger = n / n_runs / lanes
    heap = [(lane * stagger, lane) for lane in range(lanes)]
    starts = []
    for length in lengths:
        t, lane = heapq.heappop(heap)
        starts.append(t)
        heapq.heappush(heap, (t + length, lane))
    begin = torch.tensor(starts, dtype=torch.float64)
    span = torch.tensor(lengths, dtype=torch.float64)
    return part[torch.argsort(begin[run_of] + span[run_of] * u)]


def _epoch_order(gid: torch.Tensor, n_groups: int, g: torch.Generator | None, *, window: int,
                 per_rank: int, nodes: int, node: int, local_size: int,
                 local_rank: int) -> torch.Tensor:
    """The sample indices one rank reads this epoch (`g` None: no shuffling).

    1. Every rank computes the same global sequence: groups (shards) in shuffled order, each
       group's samples in random order.
    2. Node j takes the j-th contiguous slice of `per_rank * local_size` samples, so nodes get
       disjoint shards except where a slice boundary cuts one (at most nodes-1 shards an
       epoch), and exactly equal counts. A short last slice (padding) repeats its own last
       samples, which are still in that node's cache; drop_last truncates instead.
    3. Within the node, samples are shuffled within a sliding window of `window` shards.
    4. The node's ranks take every `local_size`-th sample: they read the same few shards at the
       same time through the node's one mount and cache, so the node streams each shard once.
    """
    n = gid.numel()
    node_len = per_rank * local_size
    if n == 0 or node_len == 0:
        return torch.empty(0, dtype=torch.int64)
    if g is not None:
        pos = torch.empty(n_groups, dtype=torch.float64)
        pos[torch.randperm(n_groups, generator=g)] = torch.arange(n_groups, dtype=torch.float64)
        key = pos[gid] + torch.rand(n, generator=g, dtype=torch.float64)
    else:
        key = gid.to(torch.float64)
    seq = torch.argsort(key, stable=True)[: per_rank * local_size * nodes]
    part = seq[node * node_len : (node + 1) * node_len]
    if part.numel() < node_len:
        source = part if part.numel() else seq
        need = node_len - part.numel()
        reps = math.ceil(need / source.numel())
        part = torch.cat([part, source.repeat(reps)[source.numel() * reps - need :]])
    if g is not None:
        part = _interleave(part, gid, window, g)
    return part[local_rank::local_size]


class _DatasetPaths:
    """A dataset's sample paths (`sample_paths`), built at most once per sampler: the shard
    map, the mount's stats and the announcements all need them, and for ImageNet each build
    takes ~0.2 s before the first batch."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset
        self._paths: list[str] | None = None

    def get(self) -> list[str]:
        """The paths; TypeError for a dataset without them (see sample_paths)."""
        if self._paths is None:
            self._paths = sample_paths(self._dataset)
        return self._paths


def _resolve_map(dataset: Any, paths: _DatasetPaths, given: ShardMap | None,
                 cache: bool | str | os.PathLike[str]) -> ShardMap:
    n = len(dataset)
    m = given if given is not None else shard_map(paths.get(), cache=cache)
    if len(m) != n:
        raise ValueError(f"the shard map covers {len(m)} samples, the dataset has {n}")
    if n and m.on_mount == 0:
        warnings.warn("the dataset's files are not on a shardfs mount: the shard-aware "
                      "sampler falls back to plain random order", stacklevel=3)
    elif m.on_mount < n:
        warnings.warn(f"{n - m.on_mount} of {n} files are not on a shardfs mount; they are "
                      "read in plain random order", stacklevel=3)
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


def fitting_window(stats: dict, preferred: int = DEFAULT_WINDOW) -> int:
    """The largest window (at most `preferred`) whose working set fits the mount's cache.

    The daemon caches whole shards only while the shards touched by its last
    WORKING_SET_READS reads fit its budget. With a sliding window of K shards these are the K
    open shards plus those closed within the last reads: one closes every n/K files (n files
    per shard), so about K * (1 + WORKING_SET_READS / n) shards in all (a read per file).
    """
    shards, files = int(stats["shards"]), int(stats["files"])
    budget, data = int(stats["cache_budget_bytes"]), int(stats["dataset_bytes"])
    if shards == 0 or files == 0 or data <= budget:
        return preferred  # everything fits: whole shards are always cached
    per_shard_bytes, per_shard_files = data / shards, files / shards
    reads = int(stats.get("working_set_reads") or WORKING_SET_READS)  # the daemon's window
    # A quarter of the cache is left for the spread of concurrent readers: DataLoader workers
    # read several batches at once, so their reads span shards a few windows apart (in the
    # bench, 8 batches of 32 over 36-file shards; without it the window filled the cache and
    # shards were fetched twice: 1.1-1.9x the dataset).
    k = int(SPREAD_ROOM * budget / per_shard_bytes / (1 + reads / per_shard_files))
    return max(1, min(preferred, k))


class _ShardsAhead:
    """A sampler's epoch order, told to the mount shard by shard ahead of its readers
    (announce.announce_shards): the daemon fetches the next shards whole while the window's
    shards are read, instead of learning of each when its first file is read."""

    def __init__(self, paths: _DatasetPaths, m: ShardMap, stats: dict | None,
                 window: int) -> None:
        self.paths = paths
        self.map = m
        # Shards told ahead of the one the iteration enters. The daemon acts on them only
        # when the dataset fits its cache (Reader.queue_ahead), so only then are they sent.
        self.lead = 0
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if stats is not None and int(stats["dataset_bytes"]) <= int(
                    stats["cache_budget_bytes"]):
                self.lead = window + SHARDS_AHEAD

    def wrap(self, order: torch.Tensor) -> Iterator[int]:
        if self.lead <= 0:
            return iter(order.tolist())
        try:
            paths = self.paths.get()
        except TypeError:  # a dataset without paths (shard_map given): nothing to say
            self.lead = 0
            return iter(order.tolist())
        return announce_shards(order.tolist(), _first_positions(order, self.map), paths,
                               self.lead)


def _first_positions(order: torch.Tensor, m: ShardMap) -> list[int]:
    """Positions in `order` where a shard is met first, ascending. Tensor ops: for
    ImageNet's 1.28 M indices a Python loop took twice as long (0.2 s), before the first
    batch."""
    seq = m.shard_of[order]
    on_mount = seq >= 0
    if not bool(on_mount.any()):
        return []
    n = order.numel()
    first = torch.full((len(m.shards),), n, dtype=torch.int64)
    first.scatter_reduce_(0, seq[on_mount], torch.arange(n)[on_mount], reduce="amin")
    return sorted(first[first < n].tolist())


def _first_stats(paths: _DatasetPaths, m: ShardMap) -> dict | None:
    """The stats of the mount holding the dataset's first file on a mount, if any."""
    if not m.on_mount:
        return None
    with contextlib.suppress(TypeError):
        first = int(torch.nonzero(m.shard_of >= 0)[0])
        return mount_stats(paths.get()[first])
    return None


def _window(window: int | None, stats: dict | None) -> int:
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        return window
    if stats is None:
        return DEFAULT_WINDOW
    chosen = fitting_window(stats)
    if chosen < DEFAULT_WINDOW:
        log.info("shard window %d (not %d): the mount's cache holds only %.1f shards",
                 chosen, DEFAULT_WINDOW,
                 stats["cache_budget_bytes"] * stats["shards"] / stats["dataset_bytes"])
    return chosen


@dataclasses.dataclass(frozen=True)
class _ShardPlan:
    """What both samplers derive from their dataset: its shard map, the window of shards read
    at once, the shards-ahead announcer, and the groups that the epoch order shuffles."""

    map: ShardMap
    window: int
    ahead: _ShardsAhead
    gid: torch.Tensor
    n_groups: int

    @classmethod
    def of(cls, dataset: Any, window: int | None, shard_map: ShardMap | None,
           map_cache: bool | str | os.PathLike[str]) -> _ShardPlan:
        paths = _DatasetPaths(dataset)
        m = _resolve_map(dataset, paths, shard_map, map_cache)
        stats = _first_stats(paths, m)
        chosen = _window(window, stats)
        gid, n_groups = _groups(m)
        return cls(m, chosen, _ShardsAhead(paths, m, stats, chosen), gid, n_groups)


def _generator(shuffle: bool, seed: int) -> torch.Generator | None:
    """The epoch's random generator (None: no shuffle, shards and files in order)."""
    if not shuffle:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class ShardAwareSampler(Sampler[int]):
    """Drop-in for RandomSampler over an ImageFolder whose files live on a shardfs mount.

    Each epoch is a fresh permutation of all indices that keeps locality: shards in shuffled
    order, samples shuffled within a sliding window of `window` shards (at most `window`
    shards are in use at any time), so the mount streams each shard once per epoch. Call
    `set_epoch(e)` each epoch (as with DistributedSampler); without it every iteration gets
    the next seed anyway. `window=None` picks 4, or less when the mount's cache cannot hold
    that many shards' working set (see `fitting_window`).
    """

    def __init__(self, dataset: Any, *, shuffle: bool = True, seed: int = 0,
                 window: int | None = None, shard_map: ShardMap | None = None,
                 map_cache: bool | str | os.PathLike[str] = True) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        plan = _ShardPlan.of(dataset, window, shard_map, map_cache)
        self.map, self.window, self._ahead = plan.map, plan.window, plan.ahead
        self._gid, self._n_groups = plan.gid, plan.n_groups
        self.epoch = 0
        self._epoch_set = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return len(self.map)

    def __iter__(self) -> Iterator[int]:
        g = _generator(self.shuffle, self.seed + self.epoch)
        order = _epoch_order(self._gid, self._n_groups, g, window=self.window,
                             per_rank=len(self.map), nodes=1, node=0, local_size=1, local_rank=0)
        if not self._epoch_set:
            self.epoch += 1  # RandomSampler gives each epoch a new order without set_epoch
        return self._ahead.wrap(order)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class DistributedShardSampler(Sampler[int]):
    """Drop-in for DistributedSampler that deals shards, not samples, to nodes and ranks.

    Each epoch (re-dealt by `set_epoch`), every node gets a disjoint run of shuffled shards
    (one boundary shard may be shared with the next node), the node's ranks read those shards
    together through the node's mount, and every rank yields exactly `len(self)` samples: the
    same count as DistributedSampler, padded by repeating samples or cut with `drop_last`.
    Apart from that padding each sample appears on exactly one rank per epoch.

    Ranks are grouped into nodes of `local_world_size` consecutive ranks (default: the
    LOCAL_WORLD_SIZE environment variable that torchrun sets, else 1), which is how torchrun
    and SLURM number them. A wrong grouping costs locality, never correctness.
    """

    def __init__(self, dataset: Any, *, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, window: int | None = None,
                 local_world_size: int | None = None, local_rank: int | None = None,
                 shard_map: ShardMap | None = None,
                 map_cache: bool | str | os.PathLike[str] = True) -> None:
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("pass num_replicas and rank, or initialize torch.distributed")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE") or 1
        if local_world_size < 1 or num_replicas % local_world_size:
            raise ValueError(f"local_world_size {local_world_size} does not divide "
                             f"num_replicas {num_replicas}")
        if local_rank is None:
            local_rank = _env_int("LOCAL_RANK")
        if local_rank is not None and local_rank != rank % local_world_size:
            # Our grouping must be the same bijection on every rank, so it is derived from the
            # rank; a mismatch means ranks are not numbered node by node (locality suffers).
            warnings.warn(f"LOCAL_RANK {local_rank} != rank {rank} % local_world_size "
                          f"{local_world_size}: ranks are grouped into nodes by rank",
                          stacklevel=2)
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.local_world_size = local_world_size
        self.node, self.local_rank = divmod(rank, local_world_size)
        self.num_nodes = num_replicas // local_world_size
        plan = _ShardPlan.of(dataset, window, shard_map, map_cache)
        self.map, self.window, self._ahead = plan.map, plan.window, plan.ahead
        self._gid, self._n_groups = plan.gid, plan.n_groups
        n = len(self.map)
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        g = _generator(self.shuffle, self.seed + self.epoch)
        order = _epoch_order(self._gid, self._n_groups, g, window=self.window,
                             per_rank=self.num_samples, nodes=self.num_nodes, node=self.node,
                             local_size=self.local_world_size, local_rank=self.local_rank)
        assert order.numel() == self.num_samples
        return self._ahead.wrap(order)
