"""Shard-aware samplers: epoch orders that read a shardfs mount shard by shard.

Only training code imports this module (it imports torch); the daemon never does.

The stock RandomSampler and DistributedSampler read files in uniformly random order, so every
shard is in use all the time. When the dataset is larger than the mount's cache, the daemon
cannot cache whole shards without thrashing and falls back to fetching single members (one
request per file); in a DDP job every node touches, and so fetches, every shard. The samplers
here shuffle the shards, then the samples within a sliding window of a few shards, so a mount
streams each shard once per epoch and each node only the shards dealt to it.

Which shard holds a file is read from the mount once (shardmap.py). The mapping only steers
the order: a wrong or missing mapping costs speed, never correctness (every epoch is still a
permutation of all sample indices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import warnings
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from shardfs.torch.announce import SHARDS_AHEAD, announce_shards
from shardfs.torch.order import (
    DEFAULT_WINDOW,
    _epoch_order,
    _first_positions,
    _groups,
    fitting_window,
)
from shardfs.torch.resume import Progress, Resume, make_state, read_state
from shardfs.torch.shardmap import ShardMap, mount_stats, sample_paths, shard_map

log = logging.getLogger(__name__)


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


class _Resumable:
    """state_dict() / load_state_dict() (torchdata's StatefulDataLoader) for a sampler whose
    epoch order is a function of its seed, epoch, window and shard map (shardfs/torch/resume.py):
    the state is the epoch and the indices yielded, so a resumed iteration skips those."""

    map: ShardMap
    window: int
    epoch: int
    seed: int
    shuffle: bool
    _progress: Progress | None
    _resume: Resume | None
    _map_digest: str | None

    def _identity(self) -> dict[str, Any]:
        """What must be equal for a saved position to mean the same order."""
        if self._map_digest is None:  # once: state_dict() is called for every batch
            h = hashlib.sha256("\0".join(self.map.shards).encode("utf-8", "surrogateescape"))
            h.update(array("q", self.map.shard_of.tolist()).tobytes())  # no numpy needed
            self._map_digest = h.hexdigest()[:32]
        return {"seed": self.seed, "shuffle": self.shuffle, "map": self._map_digest}

    def state_dict(self) -> dict[str, Any]:
        """Where the current iteration stands (the next one's start when none has begun)."""
        progress = self._progress or Progress(self.epoch, 0)
        length = len(self)  # type: ignore[arg-type]
        return make_state(type(self).__name__, progress, length, window=self.window,
                          **self._identity())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues the saved one: the same epoch and window, without the
        indices it yielded. ValueError if the state is of another dataset or configuration."""
        window = state.get("window") if isinstance(state, dict) else None
        resume = read_state(state, type(self).__name__, len(self),  # type: ignore[arg-type]
                            **self._identity())
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"bad window in the sampler state: {window!r}")
        if window != self.window:
            log.info("resuming with the saved window of %d shards (not %d)", window, self.window)
            self.window = window
        if resume.epoch is not None:
            self.epoch = resume.epoch
        self._resume = resume

    def _begin(self, epoch: int, order: torch.Tensor,
               ahead: Callable[[torch.Tensor], Iterator[int]],
               advance: bool = False) -> Iterator[int]:
        """The iteration of `order` (epoch `epoch`), past a loaded position if it is this
        epoch's, counted for state_dict. `advance`: the next iteration is the next epoch, once
        this one yields its first index (a DataLoader calls iter() twice before it reads)."""
        resume, self._resume = self._resume, None
        skip = resume.skip if resume is not None and resume.epoch == epoch else 0
        self._progress = progress = Progress(epoch, skip)
        return self._run(progress, ahead(order[skip:]), epoch + 1 if advance else None)

    def _run(self, progress: Progress, indices: Iterator[int],
             next_epoch: int | None) -> Iterator[int]:
        if next_epoch is not None:
            self.epoch = next_epoch
        yield from progress.count(indices)


class ShardAwareSampler(_Resumable, Sampler[int]):
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
        self._progress: Progress | None = None
        self._resume: Resume | None = None
        self._map_digest: str | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._epoch_set = True

    def __len__(self) -> int:
        return len(self.map)

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        g = _generator(self.shuffle, self.seed + epoch)
        order = _epoch_order(self._gid, self._n_groups, g, window=self.window,
                             per_rank=len(self.map), nodes=1, node=0, local_size=1, local_rank=0)
        # Without set_epoch each iteration is the next epoch, as RandomSampler gives each a new
        # order.
        return self._begin(epoch, order, self._ahead.wrap, advance=not self._epoch_set)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


class DistributedShardSampler(_Resumable, Sampler[int]):
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
        self._progress: Progress | None = None
        self._resume: Resume | None = None
        self._map_digest: str | None = None

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
        return self._begin(self.epoch, order, self._ahead.wrap)

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "num_replicas": self.num_replicas, "rank": self.rank,
                "drop_last": self.drop_last, "local_world_size": self.local_world_size}
