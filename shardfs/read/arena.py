"""Shared memory for the lookahead buffer, so FUSE worker processes serve its bytes themselves.

With `--workers N`, every read reaches a worker process, not the daemon that fetched the
announced members. Handing each member's bytes over the worker socket cost more CPU than
fetching them (pickled, copied five times, two socket hops per read) and made every read wait
for the daemon's busy event loop. Instead the daemon copies each fetched member once into this
arena, a memfd both sides map, and tells the workers where it is; a worker copies the bytes
out and only notes afterwards that it did.

Layout: `size` data bytes in blocks of BLOCK, then one uint64 generation per block. A member
occupies whole blocks from its first block on; freeing it bumps the generation of that first
block. A worker records the generation it was told with the location and checks it again after
copying: unchanged means the bytes were not freed (let alone reused) before or while it copied.
Aligned 8-byte loads and stores are atomic on the machines we run on (as in states.py).

Workers map the arena through `/proc/<daemon pid>/fd/<fd>` (same user, see workers.py); a worker
that cannot gets the bytes over its socket as before.
"""

from __future__ import annotations

import bisect
import mmap
import os

BLOCK = 4096


class Arena:
    """The daemon's side: a first-fit allocator of block runs over a shared mapping."""

    def __init__(self, size: int) -> None:
        self.blocks = max(1, -(-size // BLOCK))
        self.size = self.blocks * BLOCK
        self.total = self.size + 8 * self.blocks
        self.fd = os.memfd_create("shardfs-lookahead", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.total)
            self._map = mmap.mmap(self.fd, self.total)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self.gens = self.view[self.size :].cast("Q")
        self._starts = [0]  # free runs, sorted by start (in blocks)
        self._lengths = [self.blocks]
        self.used = 0  # bytes allocated (whole blocks)

    @property
    def path(self) -> str:
        """Where another process of the same user opens the arena."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def alloc(self, nbytes: int) -> int | None:
        """Byte offset of a run of blocks holding nbytes, or None if no free run is that long."""
        need = max(1, -(-nbytes // BLOCK))
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += need
                    self._lengths[i] -= need
                self.used += need * BLOCK
                return start * BLOCK
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back what alloc(nbytes) returned at offset; readers of it see a new gen."""
        start, need = offset // BLOCK, max(1, -(-nbytes // BLOCK))
        self.gens[start] += 1
        self.used -= need * BLOCK
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # join the one before
            i -= 1
            self._lengths[i] += need
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, need)
        if i + 1 < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)  # and the one after
            del self._starts[i + 1]

    def trim(self) -> None:
        """Give the memory of the (all free) data blocks back; they read as zeros after."""
        self._map.madvise(mmap.MADV_REMOVE, 0, self.size)

    def gen(self, offset: int) -> int:
        return self.gens[offset // BLOCK]

    def close(self) -> None:
        self.gens.release()
        self.view.release()
        self._map.close()
        os.close(self.fd)


class ArenaView:
    """A worker's read-only mapping of the daemon's arena."""

    def __init__(self, path: str, total: int, size: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(fd, total, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)
        self.gens = self.view[size:total].cast("Q")

    def copy(self, offset: int, gen: int, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the member at offset if it is still the one of generation
        gen after the copy; None when it was freed."""
        gens, block = self.gens, offset // BLOCK
        if gens[block] != gen:
            return None
        data = bytes(self.view[offset + start : offset + end])
        return data if gens[block] == gen else None
