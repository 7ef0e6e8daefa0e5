"""The shard cache on local disk: complete shards, downloads in flight and their records, the
budget, eviction, crash safety. A layer below both `catalog/` (which warms it while indexing)
and `read/` (which fetches into it); owned by the daemon process."""

from shardfs.cache.shardcache import (
    DISK_FULL,
    CacheError,
    PartFile,
    ShardCache,
    pwrite_all,
    shard_key,
)

__all__ = ["DISK_FULL", "CacheError", "PartFile", "ShardCache", "pwrite_all", "shard_key"]
