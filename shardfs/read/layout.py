"""Where each file's record lies in its shard: the byte range a GET takes to bring a member
together with the header(s) before it.

A shard filled member by member (the Lookahead's ordered fill, when the dataset fits the
cache) must end up byte for byte the shard: so each member's GET takes, besides the member, the
bytes between the previous file's data and its own (its tar header, pax or long-name headers,
entries that are no files, padding). These *extents* cut the shard into consecutive pieces,
one per plain file, from byte 0 to the padded end of the last file; what follows (the tar's
end-of-archive blocks, a zip's central directory) is left for a last GET. Built once per
mount, in a thread (Tree.files_by_shard: 4 bytes per file).
"""

from __future__ import annotations

import bisect
from array import array

from shardfs.catalog.tree import Tree

RECORD = 512  # tar's block: a member's data is padded to it


def _pad(n: int) -> int:
    return -(-n // RECORD) * RECORD


class ShardLayout:
    def __init__(self, tree: Tree, shard_sizes: list[int]) -> None:
        self._tree = tree
        self._sizes = shard_sizes
        self._order: array | None = None
        self._start: array | None = None

    def build(self) -> None:
        """Group the plain files by shard in offset order (seconds for millions of files:
        call it in a thread)."""
        self._order, self._start = self._tree.files_by_shard(len(self._sizes))

    @property
    def ready(self) -> bool:
        return self._order is not None

    def _boundary(self, j: int, first: int) -> int:
        """Where the extent of the j-th file (in shard order, `first` its shard's first)
        begins: byte 0 for the first, else the previous file's padded end (but never past
        the file's own data, for formats whose headers are not 512-byte aligned)."""
        if j == first:
            return 0
        tree, order = self._tree, self._order
        assert order is not None
        prev = order[j - 1]
        return min(_pad(tree.offset[prev] + tree.size[prev]), tree.offset[order[j]])

    def extent(self, shard: int, start: int, end: int) -> tuple[int, int]:
        """The range [lo, hi) a GET takes for the member whose data is [start, end); just
        [start, end) when the member is no plain file the layout knows (sparse, compressed)."""
        order, starts = self._order, self._start
        if order is None or starts is None:
            return start, end
        first, last = starts[shard], starts[shard + 1]
        offset = self._tree.offset
        j = bisect.bisect_left(order, start, first, last, key=offset.__getitem__)
        if j == last or offset[order[j]] != start:
            return start, end
        lo = self._boundary(j, first)
        # up to the next file's extent; the last file's ends at its padded end
        hi = self._boundary(j + 1, first) if j + 1 < last else min(self._sizes[shard], _pad(end))
        return min(lo, start), max(hi, end)
