"""Epoch orders of the shard-aware samplers: shards shuffled, samples shuffled within a sliding
window of a few shards, dealt to nodes and ranks (docs/training.md, "How the epoch order is
built"), and the window that fits a mount's cache."""

from __future__ import annotations

import heapq
import math

import torch

from shardfs.torch.shardmap import ShardMap

WORKING_SET_READS = 512  # the daemon's window when its stats do not say (older daemons)
DEFAULT_WINDOW = 4  # shards in use at once: enough mixing, a small cache working set
SPREAD_ROOM = 0.75  # of the cache, for the working set of a window (see fitting_window)


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
