"""Reads of cached shard bytes answered in C, in the process that reads the request.

With the shim in effect (docs/pyfuse3.md), its READ wrapper answers a read itself when the
shared shard states (read/states.py) say its bytes are on disk (a complete shard, or below a
fetch's frontier), this process holds a descriptor of the shard's cache file opened at the
shard's current generation, and the bytes are in the page cache; the rest comes to
`ShardFS.read` as before. This class owns what the C side reads and counts:

- `fds[shard]`: a descriptor of the shard's cache file (`KEY.part` while it is fetched; the
  rename to `KEY` keeps the same file), or -1; `fd_gen[shard]`: the states' generation when
  it was opened. Opened on the first Python read of a shard with bytes on disk (`offer`),
  closed when the generation moves on (`close_stale`: the files went away; the disk space
  goes with the last descriptor). The C side reads only while the generations match, so a
  descriptor of a gone file is never read at another file's frontier. `mode[shard]`: how C
  finds whether the bytes are in memory, by the file system under that file (`read_mode`):
  RWF_NOWAIT (ext4, xfs, btrfs ...); a plain pread where the file system refuses RWF_NOWAIT
  and holds its files in memory (tmpfs: a cache dir in /dev/shm, shards there read in place);
  and where it refuses RWF_NOWAIT and does not (overlayfs: a container's own file system),
  mincore over `maps[shard]`, a read-only mapping of the file (`map_len[shard]` bytes) that
  only mincore looks at, then a plain pread (a page reclaimed between the two makes that one
  read wait for the disk in the serving thread: rare, and never a wrong byte). Until session
  31 both sent every read of such a file to a thread: ~300-370 µs of CPU per cold file in
  place, 10x ext4's.
- `complete[shard]`, `frontier[shard]`, `nbytes`: reads and bytes answered in C since the last
  `collect`, which hands them to whoever keeps the stats (the daemon's Reader, or a worker's
  notes to it). C lists in `touched` each shard whose counts leave 0, so `collect` visits
  those rather than every shard with a descriptor (thousands on a large dataset, every 10
  ms, with C's reads held meanwhile); `close_stale` looks only when the states' `gone_total`
  moved.

The C side reads these arrays on the shim's reader thread too (docs/pyfuse3.md), which never
takes the GIL: every change and collection here happens under `shim.paused()`, the mutex the
C answers hold.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

from shardfs.cache.shardcache import open_shard_file
from shardfs.fuse import shim
from shardfs.read.diskread import READ_MINCORE, READ_NOWAIT, read_mode
from shardfs.read.states import NONE, ShardStates


def open_cache_file(shards_dir: Path, key: str, complete: bool) -> int | None:
    """A read-only descriptor of a shard's cache file, or None if it is gone. While it is
    fetched the file is `KEY.part`; the fetch may just have ended (renamed to `KEY`, the same
    file)."""
    for name in (key,) if complete else (key + ".part", key):
        try:  # a link to a shard file replaced since it was linked: None, the daemon decides
            return open_shard_file(shards_dir / name)
        except OSError:
            continue
    return None


# Seconds between collections of the C side's counts: often while reads come (the policy's
# working set must not lag them), backing off to IDLE_INTERVAL while none do (an idle mount
# with 8 workers woke 900 times a second: ~18 % of a core; ~7 % now). Longer backs-off let
# the working set lag at the start of an epoch (a random-order soak over-fetched at 160 ms).
COLLECT_INTERVAL = 0.01
IDLE_INTERVAL = 0.04


def next_interval(interval: float, busy: bool) -> float:
    """The wait before the next collection: short after reads, doubling while idle."""
    return COLLECT_INTERVAL if busy else min(2 * interval, IDLE_INTERVAL)


# Caps on one process's mappings for mincore: address space (x86-64 gives a process 128 TiB)
# and the kernel's vm.max_map_count (65,530 by default, shared with everything else).
MAX_MAPPED_BYTES = 16 << 40
MAX_MAPPED_FILES = 16384
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(slots=True)
class Collected:
    shards: list[int]  # one entry per read answered in C
    nbytes: int
    complete: int  # of them, reads of complete shards
    frontier: int  # and reads below a fetch's frontier


class FastReads:
    def __init__(self, states: ShardStates, shards_dir: Path, keys: list[str]) -> None:
        n = len(keys)
        self.states = states
        self.shards_dir = shards_dir
        self.keys = keys
        self.fds = array("i", [-1]) * n
        self.fd_gen = array("q", [0]) * n
        self.complete = array("I", [0]) * n
        self.frontier = array("I", [0]) * n
        self.nbytes = array("Q", [0])
        self.mode = array("B", [READ_NOWAIT]) * n
        self.maps = array("Q", [0]) * n
        self.map_len = array("Q", [0]) * n
        # Shards C counted reads of since the last collection (it appends a shard when its
        # counts leave 0), and [used, full]: `collect` visits these, not every open shard.
        self.touched = array("I", [0]) * n
        self.touched_len = array("I", [0, 0])
        self.mapped_bytes = 0
        self.mapped_files = 0
        self._open: set[int] = set()  # shards with a descriptor
        self._gone_seen = 0  # states.gone_total when close_stale last looked
        self._carried = Collected([], 0, 0, 0)  # counts of shards closed since collected
        avail, gen = states.addresses()
        with shim.paused():
            self.active = shim.serve_reads(avail, gen, fds=self.fds, fd_gen=self.fd_gen,
                                           complete=self.complete, frontier=self.frontier,
                                           nbytes=self.nbytes, mode=self.mode,
                                           maps=self.maps, map_len=self.map_len,
                                           touched=self.touched, touched_len=self.touched_len)

    def offer(self, shard: int) -> None:
        """Open the shard's cache file for C reads if bytes of it are on disk."""
        if not self.active or self.fds[shard] >= 0 or self.states.avail[shard] == NONE:
            return
        gen = self.states.gen[shard]
        fd = open_cache_file(self.shards_dir, self.keys[shard], complete=False)
        if fd is None:
            return  # gone meanwhile: Python reads go on as before
        if self.states.gen[shard] != gen:  # went away while we opened it
            os.close(fd)
            return
        mode = read_mode(fd)
        address = length = 0
        if mode == READ_MINCORE:
            address, length = self._map(fd)
        with shim.paused():
            self.fd_gen[shard] = gen
            self.mode[shard] = mode
            self.maps[shard], self.map_len[shard] = address, length
            self.fds[shard] = fd
        self._open.add(shard)

    def close_stale(self) -> None:
        """Close descriptors of cache files the daemon has removed since they were opened."""
        gone = self.states.gone_total[0]
        if gone == self._gone_seen:
            return  # no shard's files went away since the last look
        self._gone_seen = gone
        stale = [shard for shard in self._open if self.states.gen[shard] != self.fd_gen[shard]]
        if not stale:
            return
        with shim.paused():  # C stops using them first
            for shard in stale:
                fd, self.fds[shard] = self.fds[shard], -1
                self._open.discard(shard)
                os.close(fd)
                self._unmap(shard)
                self._take(shard, self._carried)

    def _map(self, fd: int) -> tuple[int, int]:
        """A read-only mapping of the whole file for mincore, or (0, 0) where the caps on
        this process's mappings are reached or mmap fails (C then leaves the reads to
        Python's threads, as before)."""
        try:
            length = os.fstat(fd).st_size
        except OSError:
            return 0, 0
        if (length == 0 or self.mapped_files >= MAX_MAPPED_FILES
                or self.mapped_bytes + length > MAX_MAPPED_BYTES):
            return 0, 0
        address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, MAP_FAILED):
            return 0, 0
        self.mapped_files += 1
        self.mapped_bytes += length
        return address, length

    def _unmap(self, shard: int) -> None:
        """Called under shim.paused(), so that C no longer looks at the mapping."""
        address, length = self.maps[shard], self.map_len[shard]
        if address:
            self.maps[shard] = self.map_len[shard] = 0
            _libc.munmap(ctypes.c_void_p(address), length)
            self.mapped_files -= 1
            self.mapped_bytes -= length

    def _take(self, shard: int, into: Collected) -> None:
        complete, frontier = self.complete[shard], self.frontier[shard]
        self.complete[shard] = self.frontier[shard] = 0
        into.shards += [shard] * (complete + frontier)
        into.complete += complete
        into.frontier += frontier

    def collect(self) -> Collected:
        """The reads answered in C since the last call (empty reads at a file's end too)."""
        got, self._carried = self._carried, Collected([], 0, 0, 0)
        with shim.paused():
            used, full = self.touched_len
            for shard in self._open if full else self.touched[:used]:
                if self.complete[shard] or self.frontier[shard]:
                    self._take(shard, got)
            self.touched_len[0] = self.touched_len[1] = 0
            got.nbytes, self.nbytes[0] = self.nbytes[0], 0
        return got
