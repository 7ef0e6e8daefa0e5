"""The read path of a FUSE worker process: cache files directly, the daemon for the rest.

A worker serves a read from the shard's cache file when the shared shard states say its bytes
are there (a complete shard, or below a fetch's frontier). Otherwise it asks the daemon, whose
reader applies the policy (start or join the one fetch of that shard node-wide, wait on its
frontier, or read the member) and answers either "on disk now" — the worker then reads the
file itself — or with the bytes of a member read. Reads served here are reported to the daemon
in batches, so its working set, LRU order and stats see every read of every worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import trio

from shardfs.fuse.fastread import FastReads
from shardfs.read.diskread import DiskReads
from shardfs.read.reader import ReadError
from shardfs.read.states import COMPLETE, NONE, ShardStates
from shardfs.util.rpc import Caller, ChannelClosed

NOTE_INTERVAL = 0.05  # seconds between batches of read notes to the daemon


class RemoteReader:
    def __init__(self, caller: Caller, states: ShardStates, shards_dir: Path, keys: list[str],
                 dataset_bytes: int) -> None:
        self.caller = caller
        self.states = states
        self.shards_dir = shards_dir
        self.keys = keys
        self.dataset_bytes = dataset_bytes
        self.disk = DiskReads()
        self._fds: dict[int, tuple[int, int]] = {}  # shard -> (fd, generation it was opened at)
        self._shards: list[int] = []  # reads served here since the last note
        self._bytes = 0
        self._cache_hits = 0
        self._frontier_hits = 0
        self._sent = (0, 0, 0, 0)  # disk reads inline, threaded, in C; opens: as last sent
        self.opens: Callable[[], int] = lambda: 0  # OPEN requests this worker answered
        self.fast: FastReads | None = None  # reads answered in C, reported with ours

    # -- descriptors of cache files ----------------------------------------------------------
    def _open(self, shard: int, complete: bool) -> int | None:
        key = self.keys[shard]
        names = (key,) if complete else (key + ".part", key)  # the fetch may just have ended
        for name in names:
            try:
                return os.open(self.shards_dir / name, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
        return None

    def _fd(self, shard: int, end: int) -> int | None:
        """A descriptor holding bytes [0, end) of the shard, or None if they are not on disk."""
        avail = self.states.avail[shard]
        if avail == NONE or (avail != COMPLETE and avail < end):
            return None
        gen = self.states.gen[shard]
        held = self._fds.get(shard)
        if held is not None:
            if held[1] == gen:
                return held[0]
            os.close(held[0])
            del self._fds[shard]
        fd = self._open(shard, avail == COMPLETE)
        if fd is None:
            return None
        if self.states.gen[shard] != gen:  # went away while we opened it: ask the daemon
            os.close(fd)
            return None
        self._fds[shard] = (fd, gen)
        return fd

    def close_stale(self) -> None:
        """Close descriptors of files the daemon has since removed (so their disk space goes)."""
        for shard, (fd, gen) in list(self._fds.items()):
            if self.states.gen[shard] != gen:
                os.close(fd)
                del self._fds[shard]

    # -- reads -------------------------------------------------------------------------------
    async def read(self, shard: int, member_off: int, member_size: int, off: int,
                   size: int) -> bytes | bytearray:
        if off >= member_size or size <= 0:
            return b""
        size = min(size, member_size - off)
        start = member_off + off
        fd = self._fd(shard, start + size)
        if fd is not None:
            self._note(shard, size)
            return await self.disk.pread(fd, size, start)
        for want_bytes in (False, True):
            try:
                answer = await self.caller.call("read", shard, member_off, member_size, off,
                                                size, want_bytes)
            except ChannelClosed as exc:
                raise ReadError(f"the shardfs daemon went away: {exc}") from None
            if answer[0] == "data":
                return answer[1]
            if answer[0] == "eio":
                raise ReadError(answer[1])
            fd = self._fd(shard, start + size)  # "disk": the daemon says the bytes are there
            if fd is not None:
                return await self.disk.pread(fd, size, start)
        raise ReadError(f"shard {shard}: bytes announced on disk are not there")

    def _note(self, shard: int, size: int) -> None:
        self._shards.append(shard)
        self._bytes += size
        if self.states.avail[shard] == COMPLETE:
            self._cache_hits += 1
        else:
            self._frontier_hits += 1

    async def report(self) -> None:
        """Send read notes to the daemon every NOTE_INTERVAL; runs until cancelled."""
        while True:
            await trio.sleep(NOTE_INTERVAL)
            self.close_stale()
            if self.fast is not None:
                self.fast.close_stale()
            await self.send_notes()

    async def send_notes(self) -> None:
        """Tell the daemon about the reads served here since the last note."""
        if self.fast is not None:  # answered in C from the page cache
            got = self.fast.collect()
            self._shards += got.shards
            self._bytes += got.nbytes
            self._cache_hits += got.complete
            self._frontier_hits += got.frontier
            self.disk.in_c += len(got.shards)
        disk, opens = self.disk, self.opens()
        counted = (disk.inline, disk.threaded, disk.in_c, opens)
        if self._shards or counted != self._sent:
            note = ("reads", self._shards, self._bytes, self._cache_hits, self._frontier_hits,
                    *(now - sent for now, sent in zip(counted, self._sent, strict=True)))
            self._shards = []
            self._bytes = self._cache_hits = self._frontier_hits = 0
            self._sent = counted
            await self.caller.notify(*note)

    async def on_message(self, message: tuple) -> None:
        """The daemon asks for the notes now (before it answers a stats request)."""
        if message[0] == "flush":
            await self.send_notes()
            await self.caller.notify("flushed", message[1])
