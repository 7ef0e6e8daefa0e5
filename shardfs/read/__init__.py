"""The read path's policy: the read-ahead reader (what to fetch, when, how much), its fetches,
working set and announced reads. The shard cache on disk it fetches into is `shardfs.cache`.
Owned by the daemon process.
"""
