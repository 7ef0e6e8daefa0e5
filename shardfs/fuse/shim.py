"""Load shardfs's pyfuse3/libfuse3 shim (`_shim.c`, docs/pyfuse3.md) before pyfuse3 itself.

The shim must be in the global symbol scope before pyfuse3's extension module is loaded, so
that pyfuse3's calls to `fuse_session_new` and `fuse_session_receive_buf` bind to it. Import
pyfuse3 only through `shardfs.fuse` (whose `__init__` loads this module first). Whether the
shim is really in effect is known only after `pyfuse3.init()`: `active()` says so, and the
filesystem keeps its open-based read path when it is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import logging
import os
import sys
from array import array
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_lib: ctypes.PyDLL | None = None
load_error: str | None = None
library_path: str | None = None  # the shim's file, once loaded (the lookup process loads it)


def _load() -> None:
    global _lib, load_error, library_path
    if os.environ.get("SHARDFS_NO_SHIM"):
        load_error = "disabled by SHARDFS_NO_SHIM"
        return
    if "pyfuse3" in sys.modules:
        load_error = "pyfuse3 was imported before the shim"
        return
    spec = importlib.util.find_spec("shardfs.fuse._shim")
    if spec is None or spec.origin is None:
        load_error = "not built (no C compiler or fuse3 headers at install time?)"
        return
    try:
        # PyDLL: calls keep the GIL, which pyfuse3's callbacks (run by process_one) expect.
        _lib = ctypes.PyDLL(spec.origin, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as exc:
        load_error = str(exc)
        return
    library_path = spec.origin
    _lib.shardfs_shim_ioctls.restype = ctypes.c_uint64
    _lib.shardfs_shim_arena_count.restype = ctypes.c_uint64
    _lib.shardfs_shim_arena_read.restype = ctypes.c_int64


def active() -> bool:
    """True once a FUSE session was created through the shim (call after `pyfuse3.init`)."""
    return _lib is not None and _lib.shardfs_shim_sessions() > 0


def loaded() -> bool:
    """True when the shim's library is loaded (it may still not be in effect)."""
    return _lib is not None


def init_request() -> bytes:
    """The kernel's INIT request as this process received it (or replayed it), b"" if none."""
    if _lib is None:
        return b""
    buf = ctypes.create_string_buffer(256)
    n = _lib.shardfs_shim_init_request(buf, ctypes.c_size_t(len(buf)))
    return buf.raw[:n] if n > 0 else b""


def replay_init(request: bytes) -> None:
    """Have libfuse process a recorded INIT request on the session (see session.resume)."""
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    res = _lib.shardfs_shim_replay_init(ctypes.c_char_p(request), ctypes.c_size_t(len(request)))
    if res != 0:
        raise RuntimeError(f"libfuse refused the recorded INIT request (error {-res})")


def session_fd() -> int:
    """The /dev/fuse descriptor of the mounted session."""
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    return _lib.shardfs_shim_session_fd()


class MetaTree(ctypes.Structure):
    """The tree's arrays as _shim_meta.c reads them (struct meta_tree: keep both in step)."""

    _fields_ = [
        ("names", ctypes.c_void_p), ("name_end", ctypes.c_void_p), ("kind", ctypes.c_void_p),
        ("size", ctypes.c_void_p), ("mtime", ctypes.c_void_p), ("mode", ctypes.c_void_p),
        ("children", ctypes.c_void_p), ("child_start", ctypes.c_void_p),
        ("child_count", ctypes.c_void_p), ("entries", ctypes.c_uint64),
        ("link_entry", ctypes.c_void_p), ("link_size", ctypes.c_void_p),
        ("links", ctypes.c_uint64), ("shard", ctypes.c_void_p), ("offset", ctypes.c_void_p),
        ("sparse_entry", ctypes.c_void_p), ("sparse", ctypes.c_uint64),
        ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
        ("timeout", ctypes.c_double), ("readdirplus", ctypes.c_int),
    ]


# What the C side points into: kept referenced for the life of the process.
_meta_keep: list[Any] = []
# How listings are answered (the READDIRPLUS_* of _shim_meta.c: keep both in step). With
# every entry's attributes (READDIRPLUS) the kernel builds an inode and a dentry per entry:
# measured at 300k files after drop_caches, os.walk took 1.0-1.2 s that way, 0.46 s as plain
# READDIR (names, inodes, types), against 0.4-0.7 s on ext4 (docs/tuning.md). Those inodes
# are what a file's first LOOKUP makes anyway, one round trip each, before it is read or its
# pages pushed. "pushing" (the default) lists names only, as plain READDIR does, except
# while the mount pushes pages (shardfs/fuse/pagepush.py): then every listed file gets its
# inode from the listing, and no file costs a LOOKUP round trip of its own (the pusher's or
# its reader's). The others stay for measuring again, chosen by SHARDFS_READDIRPLUS: "never"
# (plain READDIR, the default before), "adaptive" (READDIRPLUS for a directory's first
# reply, FUSE_CAP_READDIRPLUS_AUTO), "always".
READDIRPLUS_MODES = {"never": 0, "adaptive": 1, "always": 2, "pushing": 3}
DEFAULT_READDIRPLUS = "pushing"
_TYPECODES = {"name_end": "Q", "size": "Q", "mtime": "q", "mode": "H", "children": "I",
              "child_start": "I", "child_count": "I", "shard": "I", "offset": "Q"}


def _address(buf: Any) -> int:
    if isinstance(buf, array):
        return buf.buffer_info()[0] if len(buf) else 0
    if isinstance(buf, bytearray):
        return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0
    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
    raise TypeError(type(buf).__name__)


def readdirplus_mode() -> int:
    """The listing mode from SHARDFS_READDIRPLUS (default DEFAULT_READDIRPLUS)."""
    name = os.environ.get("SHARDFS_READDIRPLUS", DEFAULT_READDIRPLUS)
    if name not in READDIRPLUS_MODES:
        log.warning("SHARDFS_READDIRPLUS=%s is none of %s: %s", name,
                    ", ".join(READDIRPLUS_MODES), DEFAULT_READDIRPLUS)
        name = DEFAULT_READDIRPLUS
    if name != DEFAULT_READDIRPLUS:
        log.info("listings: %s, from SHARDFS_READDIRPLUS", name)
    return READDIRPLUS_MODES[name]


def serve_metadata(tree: Any, *, uid: int, gid: int, timeout: float,
                   readdirplus: int | None = None) -> bool:
    """Let the shim answer metadata requests from `tree` (shardfs.catalog.tree.Tree, which
    must stay unchanged and alive for the life of the process). Call before mounting; False
    when the shim is not loaded or the arrays are not laid out as the C side expects.
    `readdirplus`: a READDIRPLUS_MODES value; None: SHARDFS_READDIRPLUS's."""
    if _lib is None or array("I").itemsize != 4:
        return False
    if readdirplus is None:
        readdirplus = readdirplus_mode()
    for name, code in _TYPECODES.items():
        arr = getattr(tree, name)
        if arr.typecode != code:
            log.warning("metadata stays in Python: tree.%s has typecode %s", name, arr.typecode)
            return False
    link_entry = array("I", sorted(tree.links))
    link_size = array("Q", (len(tree.links[i]) for i in link_entry))
    # Files C must leave to Python: sparse ones and compressed ones (read/packed.py).
    sparse_entry = array("I", sorted({*tree.sparse, *tree.packed}))
    names = bytes(tree.names)
    kind = bytearray(tree.kind)
    t = MetaTree(names=_address(names), name_end=_address(tree.name_end), kind=_address(kind),
                 size=_address(tree.size), mtime=_address(tree.mtime), mode=_address(tree.mode),
                 children=_address(tree.children), child_start=_address(tree.child_start),
                 child_count=_address(tree.child_count), entries=len(tree.kind),
                 link_entry=_address(link_entry), link_size=_address(link_size),
                 links=len(link_entry), shard=_address(tree.shard),
                 offset=_address(tree.offset), sparse_entry=_address(sparse_entry),
                 sparse=len(sparse_entry), uid=uid, gid=gid, timeout=timeout,
                 readdirplus=readdirplus)
    _meta_keep[:] = [tree, names, kind, link_entry, link_size, sparse_entry]
    if _lib.shardfs_shim_serve_metadata(ctypes.byref(t), ctypes.sizeof(t)) != 0:
        return False
    set_linger(linger_us())
    return True


# Microseconds the shim waits for a next request before going back to pyfuse3's loop
# (_shim.c, "Lingering"): one wake-up of that loop costs tens of microseconds of Python.
# Off by default: on the 2-core development machine no setting showed less CPU per cold
# file in turns (docs/benchmarks-notes.md, "Cold reads: where a file's CPU goes"), where the
# readers' next request rarely comes while cores are short; bench/device_node.sh measures
# it on and off on a many-core machine.
LINGER_US = 0


def linger_us() -> int:
    """LINGER_US, or SHARDFS_LINGER_US's (0: never linger) to measure one against the other."""
    text = os.environ.get("SHARDFS_LINGER_US", "")
    if text.isdigit():
        return int(text)
    if text:
        log.warning("SHARDFS_LINGER_US=%s is not a number of microseconds: %d", text, LINGER_US)
    return LINGER_US


def set_linger(us: int) -> None:
    if _lib is not None:
        _lib.shardfs_shim_set_linger(ctypes.c_uint64(max(0, us) * 1000))


class FastReadArrays(ctypes.Structure):
    """What the shim's C reads use (struct fast_arrays in _shim_meta.c: keep both in step)."""

    _fields_ = [
        ("avail", ctypes.c_void_p), ("gen", ctypes.c_void_p), ("fds", ctypes.c_void_p),
        ("fd_gen", ctypes.c_void_p), ("complete", ctypes.c_void_p),
        ("frontier", ctypes.c_void_p), ("bytes", ctypes.c_void_p), ("mode", ctypes.c_void_p),
        ("maps", ctypes.c_void_p), ("map_len", ctypes.c_void_p), ("shards", ctypes.c_uint64),
        ("touched", ctypes.c_void_p), ("touched_len", ctypes.c_void_p),
    ]


_ARRAY_TYPES = {"fds": "i", "fd_gen": "q", "complete": "I", "frontier": "I", "nbytes": "Q",
                "mode": "B", "maps": "Q", "map_len": "Q", "touched": "I", "touched_len": "I"}


def serve_reads(avail_address: int, gen_address: int, *, fds: array, fd_gen: array,
                complete: array, frontier: array, nbytes: array, mode: array, maps: array,
                map_len: array, touched: array, touched_len: array) -> bool:
    """Let the shim answer reads of cached shard bytes in this process (see
    shardfs/fuse/fastread.py, which owns the arrays; they must stay alive and unresized).
    Needs metadata in C. `avail_address`, `gen_address`: where the shared shard states'
    int64 arrays are in this process."""
    if _lib is None or not metadata_in_c():
        return False
    given = {"fds": fds, "fd_gen": fd_gen, "complete": complete, "frontier": frontier,
             "nbytes": nbytes, "mode": mode, "maps": maps, "map_len": map_len,
             "touched": touched, "touched_len": touched_len}
    if any(given[name].typecode != code for name, code in _ARRAY_TYPES.items()) \
            or fds.itemsize != 4 or complete.itemsize != 4 or len(touched) != len(fds) \
            or len(touched_len) != 2:
        return False
    arrays = FastReadArrays(avail=avail_address, gen=gen_address, fds=_address(fds),
                            fd_gen=_address(fd_gen), complete=_address(complete),
                            frontier=_address(frontier), bytes=_address(nbytes),
                            mode=_address(mode), maps=_address(maps),
                            map_len=_address(map_len), shards=len(fds),
                            touched=_address(touched), touched_len=_address(touched_len))
    return _lib.shardfs_shim_serve_reads(ctypes.byref(arrays), ctypes.sizeof(arrays)) == 0


def arena_map(fd: int, total: int, size: int, taken: array, taken_len: array) -> int:
    """Let the shim answer reads of the lookahead arena's members (_shim_arena.c; see
    shardfs/fuse/arenareads.py, which owns the arrays: they must stay alive and unresized).
    `fd`: the arena, opened read-only (the shim maps it; the caller may close it after).
    0, or -errno."""
    if _lib is None:
        return -errno.ENOSYS
    if taken.typecode != "Q" or taken_len.typecode != "Q" or len(taken_len) != 1:
        raise ValueError("arena_map needs unsigned 64-bit arrays")
    return _lib.shardfs_shim_arena_map(fd, ctypes.c_uint64(total), ctypes.c_uint64(size),
                                       ctypes.c_void_p(_address(taken)),
                                       ctypes.c_uint64(len(taken) // 4),
                                       ctypes.c_void_p(_address(taken_len)))


def arena_landed(flat: array) -> int:
    """Members that landed, 4 unsigned 64-bit numbers each (shard, member offset, arena offset,
    generation): queued for the table without holding off the C answers (they move in at the
    next lookup). 0, or -errno."""
    assert _lib is not None
    return _lib.shardfs_shim_arena_landed(*_members(flat))


def arena_gone(flat: array) -> None:
    """Members that left the arena, as for arena_landed: the shim forgets each it still has
    there. Call within paused(): their bytes are about to be reused."""
    assert _lib is not None
    _lib.shardfs_shim_arena_gone(*_members(flat))


def _members(flat: array) -> tuple[ctypes.c_void_p, ctypes.c_uint64]:
    """A flat array of members (4 unsigned 64-bit numbers each) as the shim's (pointer,
    count) arguments."""
    if flat.typecode != "Q" or len(flat) % 4:
        raise ValueError("arena members are unsigned 64-bit numbers, 4 each")
    return ctypes.c_void_p(_address(flat)), ctypes.c_uint64(len(flat) // 4)


def arena_read(shard: int, member_off: int, off: int, n: int) -> bytes | None:
    """Bytes [off, off + n) of that member as the shim's READ would copy them (recorded as
    taken), or None when the shim would leave the read to Python. For tests."""
    assert _lib is not None
    buf = ctypes.create_string_buffer(max(1, n))
    with paused():
        got = _lib.shardfs_shim_arena_read(ctypes.c_uint32(shard), ctypes.c_uint64(member_off),
                                           ctypes.c_uint64(off), ctypes.c_uint64(n), buf)
    return None if got < 0 else buf.raw[:n]


def arena_members() -> int:
    """Members the shim's arena table holds in this process (landings queued moved in)."""
    if _lib is None:
        return 0
    with paused():
        return int(_lib.shardfs_shim_arena_count())


class PushCounts(ctypes.Structure):
    """What shardfs_shim_push counts (struct push_counts in _shim_meta.c: keep both in step)."""

    _fields_ = [
        ("looked_up", ctypes.c_uint64), ("files", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
        ("opened", ctypes.c_uint64), ("unknown", ctypes.c_uint64), ("errors", ctypes.c_uint64),
        ("listed", ctypes.c_uint64), ("dirs_listed", ctypes.c_uint64),
        ("off", ctypes.c_int32), ("error", ctypes.c_int32),
        ("stop", ctypes.c_int32), ("unused", ctypes.c_int32),
    ]


_push_fn: Any = None


def set_listing_inodes(on: bool) -> None:
    """While pages are pushed, listings give every entry its attributes (an inode in the
    kernel, for the push to store into): the "pushing" listing mode (READDIRPLUS_MODES)."""
    if _lib is not None and metadata_in_c():
        _lib.shardfs_shim_set_listing_inodes(ctypes.c_int(1 if on else 0))


def listings_give_inodes() -> bool:
    """Do listings give the kernel every listed file's inode now (READDIRPLUS_MODES)?"""
    return (_lib is not None and metadata_in_c()
            and bool(_lib.shardfs_shim_listings_give_inodes()))


def was_read(ino: int) -> bool:
    """Has any process of the mount had a READ of inode `ino` (its pages are in the page
    cache, or on their way)? False where the shim does not answer metadata."""
    return (_lib is not None and metadata_in_c()
            and bool(_lib.shardfs_shim_was_read(ctypes.c_uint64(ino - 1))))


def can_push() -> bool:
    """Can `push` run (the shim loaded, metadata answered in C: its arrays are the tree's)?"""
    return _lib is not None and metadata_in_c()


def push(fd: int, lookup: int, entries: array, first: int, count: int, parent: array,
         mountpoint: bytes, counts: PushCounts) -> int:
    """Push the plain files at `entries[first:first+count]` (one shard's, see
    shardfs/fuse/pagepush.py) from `fd`, its cache file, into the kernel's page cache, files
    without an inode looked up by the lookup process at the socket `lookup`; adds to
    `counts`. 0, or -errno when it stopped early. Releases the GIL while it runs (a ctypes
    CDLL call), so call it from a worker thread."""
    global _push_fn
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    if entries.typecode != "I" or parent.typecode != "I" or entries.itemsize != 4:
        raise ValueError("push needs 4-byte unsigned arrays")
    if _push_fn is None:
        # The same library through CDLL: its calls release the GIL (PyDLL's keep it).
        fn = ctypes.CDLL(None, handle=_lib._handle).shardfs_shim_push
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                       ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(PushCounts),
                       ctypes.c_size_t]
        _push_fn = fn
    if count <= 0:
        return 0
    if first < 0 or first + count > len(entries):
        raise IndexError("entries out of range")
    address = entries.buffer_info()[0] + first * entries.itemsize
    return _push_fn(fd, lookup, address, count, parent.buffer_info()[0], mountpoint,
                    ctypes.byref(counts), ctypes.sizeof(counts))


def reader_thread_wanted() -> bool:
    """Whether requests are read by the shim's thread of C (_shim_reader.c): yes unless
    SHARDFS_FUSE_THREAD=0, kept to measure one against the other."""
    return os.environ.get("SHARDFS_FUSE_THREAD", "1") != "0"


def use_reader() -> bool:
    """Before pyfuse3.init(): have pyfuse3 wait for requests the reader thread hands over
    (start_reader must then run in the process that serves). False if it cannot."""
    return _lib is not None and _lib.shardfs_shim_use_reader() == 0


def reader_wait_fd() -> int:
    """The descriptor pyfuse3 waits on instead of the session's (-1: none); a process forked
    to serve must keep it open."""
    return -1 if _lib is None else _lib.shardfs_shim_reader_wait_fd()


def start_reader() -> int:
    """Start the reader thread in this process, on the session it serves; 0 or -errno (the
    session is then served by pyfuse3's loop as without the thread)."""
    return -errno.ENOSYS if _lib is None else _lib.shardfs_shim_start_reader()


def stop_reader() -> None:
    """Stop the reader thread (after pyfuse3's loop has ended) and wait for it."""
    if _lib is not None:
        _lib.shardfs_shim_stop_reader()


def reader_counts() -> tuple[int, int]:
    """Requests the reader thread answered in C, and handed to pyfuse3, in this process."""
    if _lib is None:
        return 0, 0
    answered, handed = ctypes.c_uint64(), ctypes.c_uint64()
    _lib.shardfs_shim_reader_counts(ctypes.byref(answered), ctypes.byref(handed))
    return answered.value, handed.value


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold off the shim's C answers (the reader thread's included) while Python changes or
    collects what they read: fastread.py's descriptors and counts, the arena table."""
    if _lib is None:
        yield
        return
    _lib.shardfs_shim_pause_serving()
    try:
        yield
    finally:
        _lib.shardfs_shim_resume_serving()


def metadata_in_c() -> bool:
    """True once the mounted session answers metadata requests in the shim."""
    return _lib is not None and _lib.shardfs_shim_metadata_installed() == 1


def ioctls_answered() -> int:
    """FUSE_IOCTL requests the shim answered in this process (ENOTTY, as a local file does;
    see _shim_meta.c: Python's open() sends one per file). 0 without the shim."""
    return 0 if _lib is None else int(_lib.shardfs_shim_ioctls())


def process_one() -> int:
    """Receive and answer one FUSE request synchronously (INIT, before forking workers)."""
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    return _lib.shardfs_shim_process_one()


_load()
