"""Shard bytes on local disk: what has arrived, the byte budget, LRU eviction, crash safety.

Layout under the cache dir:
    lock                 flock()ed by the one daemon using this cache dir
    shards/KEY           a complete shard (KEY = hash of the shard's identity: URL+size+ETag,
                         a signed URL without its signature)
    shards/KEY.part      a shard being fetched; never taken for complete
    shards/KEY -> PATH   a shard read in place (`in_place`): a symbolic link to the shard's
                         own file, holding no bytes of the cache, with the file's mtime as
                         its own (link(); open_shard_file() checks the two still agree)
    parts/KEY.crc        how much of KEY.part is written, a CRC-32 per 4 MiB (partrecord.py)
    index/KEY.idx        a shard's member index
    trees/KEY.tree       the merged namespace for one list of shards

A shard only gets its final name after all its bytes were written and fdatasync()ed, so a
crash or kill -9 at any point leaves at most a `.part` file. The next start keeps a `.part`
whose record is sound (same size; the record's blocks are checked against the file when its
fetch resumes, reader.py) and deletes any other. Links are not adopted: each mount links the
shards it reads in place again (read/inplace.py), after checking them; an earlier mount's link
to the same file with the same mtime is kept as it is (no metadata written), and the links no
mount took again are removed before reads begin (drop_old_links).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from shardfs.cache.partrecord import PartRecord
from shardfs.util.fileio import pwrite_all
from shardfs.util.proc import leader_exited

log = logging.getLogger(__name__)


class CacheError(Exception):
    """The cache dir cannot be used (not writable, or in use by another daemon)."""


DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def shard_key(identity: str) -> str:
    return hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:40]


def open_shard_file(path: Path | str, size: int | None = None) -> int:
    """A read-only descriptor of a shard's cache file. A link (a shard read in place) is
    opened only while its target is the file that was linked: the same mtime as the link's own
    (link() gives it the file's) and, if given, `size`. A shard file replaced since (published
    anew by a rename, say) raises ShardFileChanged: its reads must not go to another file at
    the old index's offsets. OSError as os.open raises it otherwise."""
    try:  # a copied shard: one call, as before links existed
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
    linked = os.lstat(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_mtime_ns != linked.st_mtime_ns or (size is not None and st.st_size != size):
        os.close(fd)
        raise ShardFileChanged(errno.ESTALE, "a shard read in place changed since it was "
                               f"linked (mtime or size): {os.readlink(path)}", str(path))
    return fd


class ShardFileChanged(OSError):
    """A shard read in place is no longer the file that was linked."""


@dataclass(slots=True)
class CachedShard:
    key: str
    size: int
    fd: int | None = None  # opened lazily for pread, closed on eviction
    # A link to the shard's own file (read in place): no bytes of the budget, never evicted.
    linked: bool = False


@dataclass(slots=True)
class PartFile:
    """A shard being written. Bytes [0, written) are on disk and may be read with pread."""

    key: str
    size: int
    fd: int
    path: Path
    # How much of the shard is written, block by block (None: not kept, e.g. a shard read
    # only whole). A part left by an earlier daemon comes with its record: the blocks it
    # claims are checked before use (PartRecord.verify_prefix).
    record: PartRecord | None = None
    resumed: bool = False  # an earlier daemon's part file, continued


class ShardCache:
    def __init__(self, root: Path, budget: int) -> None:
        self.root = root
        self.budget = budget
        self.shards_dir = root / "shards"
        self.index_dir = root / "index"
        self.trees_dir = root / "trees"
        self.parts_dir = root / "parts"
        self._complete: OrderedDict[str, CachedShard] = OrderedDict()  # LRU order, oldest first
        self._reserved: dict[str, int] = {}  # in-progress fetches: key -> bytes reserved
        self._pins: dict[str, int] = {}  # key -> readers waiting on it; never evicted meanwhile
        # `.part` files an earlier daemon left with a sound record: reserved (counted in the
        # budget) until the reader continues them (begin) or drops them (drop_kept).
        self._kept: dict[str, PartRecord] = {}
        # Links an earlier mount left (shards read in place): not complete until this mount
        # links the same shard again, which then keeps the link as it is (link()).
        self._old_links: set[str] = set()
        self._lock_fd: int | None = None
        self.evictions = 0
        self.evicted_bytes = 0
        self.on_evict: Callable[[str], None] | None = None  # told the key of each eviction

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Create the layout, take the lock, drop crash leftovers, adopt complete shards."""
        try:
            for d in (self.root, self.shards_dir, self.index_dir, self.trees_dir,
                      self.parts_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CacheError(f"cache dir {self.root} is not usable: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK):
            os.close(self._lock_fd)
            self._lock_fd = None
            raise CacheError(f"cache dir {self.root} is not writable")
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)  # not ours: do not leak it (a retry would open another)
            self._lock_fd = None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            if holder.isdigit() and leader_exited(int(holder)):
                self._lock_fd = self._replace_lock(int(holder))
            else:
                raise CacheError(
                    f"cache dir {self.root} is in use by another shardfs daemon "
                    f"(pid {holder or '?'}); give each mount its own --cache-dir"
                ) from None
        try:
            os.ftruncate(self._lock_fd, 0)
            pwrite_all(self._lock_fd, str(os.getpid()).encode(), 0)
        except OSError as exc:  # e.g. a full disk: a clear error, not a traceback
            os.close(self._lock_fd)
            self._lock_fd = None
            raise CacheError(f"cache dir {self.root} is not usable: {exc.strerror}") from None
        self._adopt_existing()

    def _replace_lock(self, dying: int) -> int:
        """The lock's holder is dying (leader_exited): killed while a thread of it waits in a
        FUSE request on its own mount, which only the daemon now starting can answer, so it
        would hold the lock until this daemon gave up. It runs no more code of its own: take
        the cache dir over under a new lock file (its lock stays on the old, unlinked one)."""
        log.warning("cache dir %s: its lock is held by pid %d, which was killed and waits on "
                    "a FUSE request only this daemon can answer; taking the cache dir over",
                    self.root, dying)
        fresh = self.root / f"lock.{os.getpid()}"
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(fresh, self.root / "lock")
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            raise CacheError(f"cache dir {self.root} is not usable: {exc.strerror}") from None
        return fd

    def _adopt_existing(self) -> None:
        found = []
        for entry in os.scandir(self.shards_dir):
            if entry.is_symlink():  # read in place by an earlier mount: linked again if so
                self._old_links.add(entry.name)
                continue
            if entry.name.endswith(".part"):
                self._keep_part(entry.name[: -len(".part")], entry.stat().st_size)
                continue
            if ".tmp" in entry.name:
                os.unlink(entry.path)  # a half-written file of a crashed run
                continue
            st = entry.stat()
            found.append((st.st_atime_ns, entry.name, st.st_size))
        for _, key, size in sorted(found):  # oldest access first = LRU order
            self._complete[key] = CachedShard(key, size)
        for entry in os.scandir(self.parts_dir):  # records whose part is gone (or committed)
            if entry.name.removesuffix(".crc") not in self._kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        # Kept parts first give way if the budget shrank below them (nothing else could).
        for key in sorted(self._kept, key=lambda k: self._kept[k].claimed):
            if sum(self._reserved.values()) <= self.budget:
                break
            self.drop_kept(key)
        self.evict_to_fit(0)  # the budget may have shrunk since the last run
        # Half-written index/tree files (`*.tmpPID`) and tree-build lists (`*.list`) of a run
        # that crashed or hit a full disk: a partial tree can be 100 MB, and each failed mount
        # on a full disk left one more (issue #7). We hold the lock: nobody is writing them.
        for directory in (self.index_dir, self.trees_dir):
            for entry in os.scandir(directory):
                if ".tmp" in entry.name or entry.name.endswith(".list"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def _keep_part(self, key: str, size: int) -> None:
        """A fetch an earlier daemon did not finish: kept (reserved) if its record is sound
        and claims something, else deleted."""
        record = PartRecord.load(self.record_path(key), size)
        if record is None or record.claimed == 0:
            if record is not None:
                record.close()
            (self.shards_dir / f"{key}.part").unlink(missing_ok=True)
            self.record_path(key).unlink(missing_ok=True)
            log.info("removed partial shard left by an earlier run: %s.part", key)
            return
        self._kept[key] = record
        self._reserved[key] = size
        log.info("kept partial shard left by an earlier run: %s.part (%d of %d bytes "
                 "recorded), continued when its fetch starts", key, record.claimed, size)

    @property
    def kept(self) -> dict[str, int]:
        """Parts left by an earlier daemon, not continued yet: key -> bytes claimed."""
        return {key: record.claimed for key, record in self._kept.items()}

    def drop_kept(self, key: str) -> None:
        """Delete a kept part (its shard is not in this mount, or can only be read whole)."""
        record = self._kept.pop(key, None)
        if record is None:
            return
        record.remove()
        self._reserved.pop(key, None)
        (self.shards_dir / f"{key}.part").unlink(missing_ok=True)
        log.info("removed partial shard left by an earlier run: %s.part", key)

    def record_path(self, key: str) -> Path:
        return self.parts_dir / f"{key}.crc"

    def close(self) -> None:
        for record in self._kept.values():
            record.close()
        self._kept.clear()
        for shard in self._complete.values():
            if shard.fd is not None:
                os.close(shard.fd)
                shard.fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- accounting ------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(s.size for s in self._complete.values() if not s.linked) + \
            sum(self._reserved.values())

    @property
    def complete_count(self) -> int:
        return len(self._complete)

    @property
    def linked_count(self) -> int:
        """Complete shards read in place (link)."""
        return sum(s.linked for s in self._complete.values())

    def has(self, key: str) -> bool:
        return key in self._complete

    def is_linked(self, key: str) -> bool:
        """A shard read in place: it takes no room in the cache."""
        shard = self._complete.get(key)
        return shard is not None and shard.linked

    def evict_to_fit(self, need: int) -> bool:
        """Evict least recently used unpinned shards until `need` more bytes fit."""
        used = self.used
        if used + need <= self.budget:
            return True
        # Evict nothing when even evicting every unpinned shard would not make room.
        evictable = sum(s.size for s in self._complete.values() if self._evictable(s))
        if used - evictable + need > self.budget:
            return False
        for key in list(self._complete):
            if used + need <= self.budget:
                break
            shard = self._complete[key]
            if not self._evictable(shard):
                continue
            self._evict(shard)
            used -= shard.size
        return used + need <= self.budget

    def trim(self, need: int = 0) -> None:
        """Evict least recently used unpinned shards while the cache (plus `need`) is over its
        budget — as far as it goes, unlike `evict_to_fit`, which evicts nothing when that
        cannot make room. Over budget happens only when the budget was lowered (disk full)
        under fetches already reserved: older shards make way as they complete."""
        for key in list(self._complete):
            if self.used + need <= self.budget:
                return
            if self._evictable(self._complete[key]):
                self._evict(self._complete[key])

    def evict_lru(self) -> bool:
        """Evict the least recently used unpinned shard (to make room for indexes and the
        tree on a full disk); False if there is none."""
        for shard in self._complete.values():
            if self._evictable(shard):
                self._evict(shard)
                return True
        return False

    def _evictable(self, shard: CachedShard) -> bool:
        """Unpinned, and holding bytes (a link frees nothing)."""
        return not shard.linked and not self._pins.get(shard.key)

    def touch(self, key: str) -> None:
        """Mark a complete shard most recently used (read by another process)."""
        if key in self._complete:
            self._complete.move_to_end(key)

    def _evict(self, shard: CachedShard) -> None:
        del self._complete[shard.key]
        if shard.fd is not None:
            os.close(shard.fd)
        (self.shards_dir / shard.key).unlink(missing_ok=True)
        if self.on_evict is not None:
            self.on_evict(shard.key)
        self.evictions += 1
        self.evicted_bytes += shard.size
        log.info("evicted shard %s (%d bytes) to stay within budget", shard.key, shard.size)

    def disk_full(self) -> int:
        """The disk under the cache filled up before the budget did (a small filesystem, other
        files, a quota): lower the budget to what the disk holds now and evict down to it.
        Whole-shard fetches then stay within what fits (or stop, when not even one shard
        fits, and readers read members directly) instead of failing again and again. Call it
        after abort()ing the fetch that failed. The budget stays lowered until remount."""
        held = 0
        try:
            st = os.statvfs(self.shards_dir)
            free = st.f_bavail * st.f_frsize
            for entry in os.scandir(self.shards_dir):
                with contextlib.suppress(FileNotFoundError):
                    held += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            free = 0
        budget = max(0, min(self.budget, held + free))
        if budget < self.budget:
            log.warning("cache disk full under %s: budget lowered from %d to %d bytes "
                        "(what the disk holds); reads of shards that do not fit read their "
                        "members directly", self.root, self.budget, budget)
            self.budget = budget
            self.trim()
        return self.budget

    def pin(self, key: str) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]

    # -- complete shards -------------------------------------------------------------------
    def get(self, key: str) -> CachedShard | None:
        """A complete shard with an open fd, marked most recently used; None if not cached."""
        shard = self._complete.get(key)
        if shard is None:
            return None
        self._complete.move_to_end(key)
        if shard.fd is None:
            try:
                shard.fd = open_shard_file(self.shards_dir / key, shard.size)
            except FileNotFoundError:  # removed behind our back: forget it
                del self._complete[key]
                return None
            except ShardFileChanged as exc:  # fetched from now on: the fetch names the change
                log.warning("%s; its reads now fail as a changed shard's do", exc.strerror)
                del self._complete[key]
                return None
        return shard

    def link(self, key: str, target: str, size: int, mtime_ns: int) -> None:
        """Take the shard file at `target` as complete, in place: `shards/KEY` becomes a
        symbolic link to it (the workers and the page push open shards by that name), whose
        own mtime is `mtime_ns`, the file's as checked against its index: opening it checks
        the file still has it (open_shard_file). It holds none of the budget and is never
        evicted. A part an earlier daemon left of it is dropped. OSError: not linked."""
        self.drop_kept(key)
        if key in self._complete or key in self._reserved:
            return
        # Per link made: a symlink and its mtime (metadata writes: 10,000 shards took 0.7-2.3
        # s of a mount on a slow disk). A link an earlier mount left to the same file with
        # the same mtime is kept as it is: a remount writes nothing.
        path = os.path.join(self.shards_dir, key)
        if key in self._old_links:
            self._old_links.discard(key)
            try:
                if os.readlink(path) == target and os.lstat(path).st_mtime_ns == mtime_ns:
                    self._complete[key] = CachedShard(key, size, linked=True)
                    return
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.symlink(target, path)
        try:
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        except OSError:
            os.unlink(path)  # a link without the mtime would never open
            raise
        self._complete[key] = CachedShard(key, size, linked=True)

    def drop_old_links(self) -> int:
        """Remove the links an earlier mount left that this one did not link again (its
        shards are not read in place now: `in_place: off`, another data set, a file that
        changed); returns how many. After the link step, before reads begin."""
        dropped = 0
        for key in self._old_links:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.shards_dir, key))
                dropped += 1
        self._old_links.clear()
        return dropped

    # -- shards being fetched --------------------------------------------------------------
    def reserve(self, key: str, size: int, *, evict: bool = True) -> bool:
        """Claim room for a shard about to be fetched; False if it cannot fit."""
        if key in self._kept:
            return self._reserved[key] == size  # reserved since start-up
        if key in self._reserved or key in self._complete:
            return False
        if size > self.budget:
            return False
        ok = self.evict_to_fit(size) if evict else self.used + size <= self.budget
        if ok:
            self._reserved[key] = size
        return ok

    def begin(self, key: str, size: int, *, record: bool = True) -> PartFile:
        """The .part file for a reserved shard: the one an earlier daemon left (kept at
        start-up, `resumed`, with its record), else a new one (sparse, full size, so pread
        works) with a new record unless `record` is False (a shard read only whole, which
        cannot be continued)."""
        path = self.shards_dir / f"{key}.part"
        kept = self._kept.pop(key, None)
        if kept is not None:
            if record:
                try:
                    fd = os.open(path, os.O_RDWR)
                    if os.fstat(fd).st_size == size:
                        return PartFile(key, size, fd, path, kept, resumed=True)
                    os.close(fd)
                except OSError:  # gone, or unreadable: start afresh below
                    pass
            kept.remove()  # not continued: start afresh below
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            part = PartFile(key, size, fd, path)
            if record:
                part.record = PartRecord.create(self.record_path(key), size)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return part

    def leave(self, part: PartFile) -> None:
        """A fetch this daemon will not finish (it exits for a new daemon to take the mount
        over): close the files and leave them, so that the next daemon continues the fetch
        from what is written. Without a record the part is of no use: dropped."""
        self._reserved.pop(part.key, None)
        if part.record is None:
            self.abort(part, part.key)
            return
        os.close(part.fd)
        part.record.close()

    async def commit(self, part: PartFile) -> CachedShard:
        """Make a fully written shard durable, then give it its final name."""
        await trio.to_thread.run_sync(os.fdatasync, part.fd)
        os.replace(part.path, self.shards_dir / part.key)
        if part.record is not None:  # after the rename: a part never lacks its record
            part.record.remove()
        self._reserved.pop(part.key, None)
        self.trim(part.size)
        shard = CachedShard(part.key, part.size, fd=part.fd)
        self._complete[part.key] = shard
        return shard

    def abort(self, part: PartFile | None, key: str) -> None:
        """Drop a fetch that failed: its bytes are never used again."""
        self._reserved.pop(key, None)
        if part is not None:
            os.close(part.fd)
            part.path.unlink(missing_ok=True)
            if part.record is not None:
                part.record.remove()

    # -- index and tree files --------------------------------------------------------------
    def index_path(self, key: str) -> Path:
        return self.index_dir / f"{key}.idx"

    def tree_path(self, key: str) -> Path:
        return self.trees_dir / f"{key}.tree"
