"""Reads of sparse members: holes are zeros, data runs come through the reader.

Kept apart from the reader's policy: a sparse file's data runs are one stored member
(offset, stored size) as far as the reader is concerned; this only maps logical offsets.
"""

from __future__ import annotations

from shardfs.catalog.sparse import HOLE, SparseMap, pieces
from shardfs.catalog.tree import FileRef
from shardfs.read.reader import Reader


async def read_sparse(reader: Reader, ref: FileRef, smap: SparseMap, off: int,
                      size: int) -> bytes:
    """Logical bytes [off, off+size) of the sparse file `ref` (clipped to its end)."""
    stored = smap.stored
    out = []
    for at, length in pieces(smap, ref.size, off, size):
        if at == HOLE:
            out.append(bytes(length))
        else:
            out.append(await reader.read(ref.shard, ref.offset, stored, at, length))
    return b"".join(out)
