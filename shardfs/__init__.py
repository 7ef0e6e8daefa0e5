"""shardfs: mount remote tar shards as a read-only directory tree."""

__version__ = "0.1.0"
