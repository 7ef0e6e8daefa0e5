"""What is in the shards: tar parsing, per-shard index files, the catalog built before the mount
appears, and the immutable tree (the namespace) every serving process shares. No network here
except through `shardfs.sources`, no FUSE.
"""
