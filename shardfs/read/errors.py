"""The read layer's one error: what a FUSE read answers with EIO."""


class ReadError(Exception):
    """A read that must fail with EIO (source unreachable past the deadline, shard changed,
    a shard's file shorter than its index says)."""
