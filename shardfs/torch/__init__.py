"""Training-side helpers for datasets on a shardfs mount (they import torch; the daemon never
imports this package): `Lookahead` (any sampler's exact order, announced to the daemon ahead of
use) and the shard-aware samplers (orders that read a mount shard by shard). docs/training.md."""

from shardfs.torch.lookahead import Lookahead
from shardfs.torch.order import fitting_window
from shardfs.torch.samplers import DistributedShardSampler, ShardAwareSampler
from shardfs.torch.shardmap import ShardMap, mount_stats, sample_paths, shard_map

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
