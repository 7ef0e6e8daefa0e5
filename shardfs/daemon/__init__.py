"""The daemon: the process that owns a mount (lifecycle, signals, readiness, control socket,
metrics). It runs the read-ahead policy (`shardfs.read`) and the network (`shardfs.sources`),
and serves FUSE requests itself or through worker processes (`shardfs.fuse`).
"""
