"""The read path of a FUSE worker process: cache files directly, the daemon for the rest.

A worker serves a read of a member `Lookahead` holds in the shared arena from there (see
shardfs/read/arena.py; the shim does it in C when it can, arenareads.py), else from the
shard's cache file when the shared shard states say its bytes are there (a complete shard, or
below a fetch's frontier). Otherwise it asks the daemon, whose
reader applies the policy (start or join the one fetch of that shard node-wide, wait on its
frontier, or read the member) and answers either "on disk now" — the worker then reads the
file itself — or with the bytes of a member read. Reads served here are reported to the daemon
in batches, so its working set, LRU order and stats see every read of every worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import trio

from shardfs.fuse.arenareads import ArenaReads, in_c_wanted
from shardfs.fuse.fastread import COLLECT_INTERVAL, FastReads, next_interval, open_cache_file
from shardfs.read.arena import ArenaView
from shardfs.read.diskread import DiskReads
from shardfs.read.reader import ReadError
from shardfs.read.states import COMPLETE, NONE, ShardStates
from shardfs.util.rpc import Caller, ChannelClosed

log = logging.getLogger(__name__)
NOTE_INTERVAL = COLLECT_INTERVAL  # seconds between batches of read notes (more when idle)


def daemon_gone() -> NoReturn:
    """The daemon died (or is being replaced): end this worker at once, answering nothing.
    Its zygote then has the kernel queue its unanswered requests again for whoever serves
    the connection next (a new daemon taking the mount over), so no read fails."""
    log.warning("the shardfs daemon went away: FUSE worker %d exits, its requests are "
                "queued again", os.getpid())
    logging.shutdown()
    os._exit(0)


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
        # disk reads inline, threaded, in C; OPENs; IOCTLs answered in C; requests the shim's
        # reader thread answered in C and handed to pyfuse3: as last sent
        self._sent = (0, 0, 0, 0, 0, 0, 0)
        self._sending = trio.Lock()  # one note at a time (see send_notes)
        self.opens: Callable[[], int] = lambda: 0  # OPEN requests this worker answered
        self.ioctls: Callable[[], int] = lambda: 0  # IOCTL requests its shim answered
        self.fuse_requests: Callable[[], tuple[int, int]] = lambda: (0, 0)  # its reader thread's
        self.fast: FastReads | None = None  # reads answered in C, reported with ours
        # Members the daemon fetched ahead (shardfs.torch.Lookahead) in the shared arena:
        # (shard, member offset) -> (arena offset, generation); see shardfs/read/arena.py.
        # Where the locations are kept: the shim's table when it answers these reads (with
        # `fast`), else `_ahead` for the Python path below.
        self.arena: ArenaView | None = None
        self.arena_in_c: ArenaReads | None = None
        self._ahead: dict[tuple[int, int], tuple[int, int]] = {}
        # arena reads not yet told: (shard, member offset, arena offset, bytes, in C)
        self._taken: list[tuple[int, int, int, int, bool]] = []
        self._taken_news = trio.Event()

    # -- descriptors of cache files ----------------------------------------------------------
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
        fd = open_cache_file(self.shards_dir, self.keys[shard], avail == COMPLETE)
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
        if self._ahead:  # first: a member read from the arena is let go of at once
            where = self._ahead.get((shard, member_off))
            if where is not None:
                assert self.arena is not None
                data = self.arena.copy(where[0], where[1], off, off + size)
                if data is not None:
                    self._shards.append(shard)
                    self._bytes += size
                    self._taken.append((shard, member_off, where[0], size, False))
                    self._taken_news.set()
                    return data
                del self._ahead[(shard, member_off)]  # freed meanwhile
        fd = self._fd(shard, start + size)
        if fd is not None:
            self._note(shard, size)
            return await self.disk.pread(fd, size, start)
        for want_bytes in (False, True):
            try:
                answer = await self.caller.call("read", shard, member_off, member_size, off,
                                                size, want_bytes)
            except ChannelClosed:
                daemon_gone()
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
        """Send read notes to the daemon every NOTE_INTERVAL (backing off while there are
        none), and arena reads as they happen; runs until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_taken)
            interval = NOTE_INTERVAL
            while True:
                await trio.sleep(interval)
                self.close_stale()
                if self.fast is not None:
                    self.fast.close_stale()
                interval = next_interval(interval, await self.send_notes())

    async def _report_taken(self) -> None:
        """Tell the daemon which arena members were read (it frees them and fetches on): soon,
        since fetching waits for that room, but batched, since reads come in bursts."""
        while True:
            await self._taken_news.wait()
            self._taken_news = trio.Event()
            await self._tell_taken()

    async def _tell_taken(self) -> None:
        if self._taken:
            taken, self._taken = self._taken, []
            with contextlib.suppress(ChannelClosed):
                await self.caller.notify("taken", taken)

    async def send_notes(self) -> bool:
        """Tell the daemon about the reads served here since the last note; False if there
        were none. One at a time: a flush's "flushed" must not overtake a note still being
        sent by the periodic report (stats would miss those reads and count them later)."""
        async with self._sending:
            return await self._send_notes()

    async def _send_notes(self) -> bool:
        if self.arena_in_c is not None:  # arena reads answered in C
            taken = self.arena_in_c.collect()
            for shard, member_off, at, size in taken:
                self._shards.append(shard)
                self._bytes += size
                self._taken.append((shard, member_off, at, size, True))
            # told now, before the note: a flush's "flushed" must find them counted
            await self._tell_taken()
        if self.fast is not None:  # answered in C from the page cache
            got = self.fast.collect()
            self._shards += got.shards
            self._bytes += got.nbytes
            self._cache_hits += got.complete
            self._frontier_hits += got.frontier
            self.disk.in_c += len(got.shards)
        disk = self.disk
        counted = (disk.inline, disk.threaded, disk.in_c, self.opens(), self.ioctls(),
                   *self.fuse_requests())
        if self._shards or counted != self._sent:
            note = ("reads", self._shards, self._bytes, self._cache_hits, self._frontier_hits,
                    *(now - sent for now, sent in zip(counted, self._sent, strict=True)))
            self._shards = []
            self._bytes = self._cache_hits = self._frontier_hits = 0
            self._sent = counted
            await self.caller.notify(*note)
            return True
        return False

    async def on_message(self, message: tuple) -> None:
        """The daemon asks for the notes now (before it answers a stats request)."""
        if message[0] == "flush":
            await self.send_notes()
            await self.caller.notify("flushed", message[1])
        elif message[0] == "lookahead" and self.arena_in_c is not None:
            # the shim's table only: a read it leaves to Python (its record of reads full)
            # goes to the daemon, which serves it from the arena too
            self.arena_in_c.landed(message[1])
            self.arena_in_c.gone(message[2])
        elif message[0] == "lookahead" and self.arena is not None:
            ahead = self._ahead
            for shard, member_off, at, gen in message[1]:
                ahead[shard, member_off] = (at, gen)
            for shard, member_off, at, gen in message[2]:
                if ahead.get((shard, member_off)) == (at, gen):
                    del ahead[shard, member_off]
        elif message[0] == "arena":
            try:
                self.arena = ArenaView(*message[1:])
            except OSError as exc:  # e.g. /proc hidden from us: the daemon sends bytes then
                log.warning("cannot map the lookahead arena %s: %s", message[1], exc)
                return
            if self.fast is not None and in_c_wanted(self.fast.active):
                try:
                    self.arena_in_c = ArenaReads(*message[1:])
                except OSError as exc:  # Python serves them (above)
                    log.warning("arena reads stay in Python: %s", exc)
