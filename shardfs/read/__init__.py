"""The read path's policy and storage: the read-ahead reader (what to fetch, when, how much) and
the shard cache on local disk (budget, eviction, crash safety). Owned by the daemon process.
"""
