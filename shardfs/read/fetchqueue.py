"""Shards waiting for a whole-shard fetch slot, in the order they were asked for, and their
bytes: a shard queued here will be fetched whole, so the reader counts those bytes in the
duplicate allowance of member reads (shardfs/read/allowance.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class FetchQueue:
    def __init__(self, sizes: Sequence[int]) -> None:
        self._sizes = sizes
        self._shards: OrderedDict[int, None] = OrderedDict()
        self.nbytes = 0  # bytes of the shards queued

    def add(self, shard: int) -> bool:
        """Queue a shard at the end (if it is not queued yet); True when it was not."""
        if shard in self._shards:
            return False
        self._shards[shard] = None
        self.nbytes += self._sizes[shard]
        return True

    def discard(self, shard: int) -> None:
        if self._shards.pop(shard, 0) is None:
            self.nbytes -= self._sizes[shard]

    def popleft(self) -> int:
        shard, _ = self._shards.popitem(last=False)
        self.nbytes -= self._sizes[shard]
        return shard

    def __contains__(self, shard: object) -> bool:
        return shard in self._shards

    def __len__(self) -> int:
        return len(self._shards)

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._shards))  # a copy: callers start (and so dequeue) as they go
