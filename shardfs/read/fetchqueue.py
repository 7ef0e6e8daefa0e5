"""Shards waiting for a whole-shard fetch slot, oldest first, and how many bytes they hold.

The bytes matter to the duplicate allowance (reader.py, `_early_allowed`): a queued shard will
be fetched whole, so a member read of it now fetches bytes a second time, and the allowance
counts the bytes of queued shards as well as those of fetches started."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class FetchQueue:
    """An ordered set of shard numbers with the sum of their sizes kept as they come and go
    (O(1) per change: the queue may hold thousands of shards and is read on every early read)."""

    __slots__ = ("_order", "_sizes", "bytes")

    def __init__(self, sizes: Sequence[int]) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()
        self._sizes = sizes
        self.bytes = 0

    def add(self, shard: int) -> None:
        """Queue `shard` at the end; one already queued keeps its place."""
        if shard not in self._order:
            self._order[shard] = None
            self.bytes += self._sizes[shard]

    def discard(self, shard: int) -> None:
        if shard in self._order:
            del self._order[shard]
            self.bytes -= self._sizes[shard]

    def pop_oldest(self) -> int:
        shard, _ = self._order.popitem(last=False)
        self.bytes -= self._sizes[shard]
        return shard

    def __contains__(self, shard: object) -> bool:
        return shard in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)
