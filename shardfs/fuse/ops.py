"""pyfuse3 Operations: translates FUSE requests to tree lookups and reader calls; no policy.

Metadata never touches the network: the tree is in memory and immutable, so entries and
attributes get kernel timeouts longer than any training run and readdir (always readdirplus
in pyfuse3) carries full attributes.

Files need no OPEN: when our pyfuse3 shim is in effect (`no_open`), OPEN is answered with
ENOSYS once, after which the kernel sends no OPEN or RELEASE for the life of the mount, keeps
file pages cached across opens, and READ carries the inode (the shim puts it in `fh`). Without
the shim, files are opened with keep_cache and the handle is the inode, so `read` is the same.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Protocol

import pyfuse3  # after the shim: shardfs.fuse's __init__ loads it first
from cachetools import LRUCache

from shardfs.catalog.dirmap import PREFIX as PAGE_PREFIX
from shardfs.catalog.dirmap import encode_pages
from shardfs.catalog.shardindex import KIND_DIR, KIND_FILE, KIND_LINK
from shardfs.catalog.tree import Tree
from shardfs.fuse.fastread import FastReads
from shardfs.read.packed import PackedReads
from shardfs.read.reader import ReadError
from shardfs.read.sparse import read_sparse

log = logging.getLogger(__name__)

# Seconds the kernel may cache entries and attributes: the tree is immutable for the life of
# the mount, so longer than any training run (a year).
TIMEOUT = 365 * 24 * 3600.0
XATTR_PREFIX = b"user.shardfs."
FILE_XATTRS = (b"user.shardfs.shard", b"user.shardfs.offset", b"user.shardfs.size")
# Compressed members only (zip deflate etc.): the codec, and the bytes stored at `offset`.
PACKED_XATTRS = (b"user.shardfs.codec", b"user.shardfs.stored")
STATS_XATTR = b"user.shardfs.stats"  # on the root: JSON counters, read by `shardfs stats`
_S_IFREG_RO = stat.S_IFREG | 0o444  # read-only mount: files are readable, never writable


class MemberReader(Protocol):
    """Where file bytes come from: the daemon's Reader, or a worker's RemoteReader."""

    dataset_bytes: int

    async def read(self, shard: int, member_off: int, member_size: int, off: int,
                   size: int) -> bytes | bytearray: ...


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class ShardFS(pyfuse3.Operations):
    def __init__(self, tree: Tree, reader: MemberReader | None, shard_urls: list[str], *, uid: int,
                 gid: int, stats_json: Callable[[], Awaitable[bytes]] | None = None) -> None:
        super().__init__()
        self.tree = tree
        self.reader = reader
        self.shard_urls = shard_urls
        self.uid = uid
        self.gid = gid
        self.stats_json = stats_json
        self.no_open = False  # set once mounted: True when the shim passes inodes on READ
        self.opens = 0  # OPEN requests received (with no_open: the first one only)
        self.fast: FastReads | None = None  # reads the shim answers in C (complete shards)
        # Directory inode -> its file->shard xattr pages. Readers go one directory at a time
        # (listxattr, then each page), so a few entries suffice and memory stays flat.
        self._pages: LRUCache = LRUCache(maxsize=8)
        self.packed = PackedReads()  # compressed members, decoded (zip deflate etc.)

    # -- metadata --------------------------------------------------------------------------
    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        # On the path of every LOOKUP and of every entry of READDIRPLUS: kept lean (plain
        # array reads, no helper calls for the common case of a file).
        tree = self.tree
        i = ino - 1
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ino
        attr.entry_timeout = TIMEOUT
        attr.attr_timeout = TIMEOUT
        if tree.kind[i] == KIND_FILE:
            attr.st_mode = _S_IFREG_RO | (tree.mode[i] & 0o111)
            size = tree.size[i]
            attr.st_size = size
            attr.st_blocks = (size + 511) >> 9
        else:
            attr.st_mode = tree.st_mode(ino)
            attr.st_size = tree.st_size(ino)
        attr.st_nlink = 1
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        attr.st_blksize = 1 << 17
        mtime_ns = tree.mtime[i] * 1_000_000_000
        attr.st_mtime_ns = mtime_ns
        attr.st_ctime_ns = mtime_ns
        attr.st_atime_ns = mtime_ns
        return attr

    def _check(self, ino: int) -> None:
        if not self.tree.valid(ino):
            raise pyfuse3.FUSEError(errno.ENOENT)

    async def lookup(self, parent_inode, name, ctx=None):
        self._check(parent_inode)
        if name == b".":
            return self._attr(parent_inode)
        if name == b"..":
            return self._attr(self.tree.parent[parent_inode - 1] + 1)
        ino = self.tree.lookup(parent_inode, name)
        if ino is None:
            # st_ino=0 lets the kernel cache the negative answer for entry_timeout.
            attr = pyfuse3.EntryAttributes()
            attr.st_ino = 0
            attr.entry_timeout = TIMEOUT
            return attr
        return self._attr(ino)

    async def getattr(self, inode, ctx=None):
        self._check(inode)
        return self._attr(inode)

    async def readlink(self, inode, ctx):
        self._check(inode)
        if self.tree.kind[inode - 1] != KIND_LINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self.tree.links.get(inode - 1, b"")

    async def opendir(self, inode, ctx):
        self._check(inode)
        if not self.tree.is_dir(inode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        # Positions in the (immutable) child list are the stable readdir offsets. A page of
        # the reply holds a few dozen entries: walk the child array lazily from `start_id`.
        tree = self.tree
        p = fh - 1
        first, count, children = tree.child_start[p], tree.child_count[p], tree.children
        reply, name, attr = pyfuse3.readdir_reply, tree.name, self._attr
        for pos in range(start_id, count):
            child = children[first + pos] + 1
            if not reply(token, name(child), attr(child), pos + 1):
                return

    async def releasedir(self, fh):
        return None

    async def statfs(self, ctx):
        st = pyfuse3.StatvfsData()
        st.f_bsize = 1 << 17
        st.f_frsize = 512
        st.f_blocks = self.reader.dataset_bytes // 512
        st.f_bfree = 0
        st.f_bavail = 0
        st.f_files = len(self.tree)
        st.f_ffree = 0
        st.f_favail = 0
        st.f_namemax = 255
        return st

    # -- data ------------------------------------------------------------------------------
    async def open(self, inode, flags, ctx):
        self.opens += 1
        if self.no_open:
            # The kernel stops sending OPEN/RELEASE from here on. The mount is read-only
            # (`ro`), so the VFS itself refuses opens for writing.
            raise pyfuse3.FUSEError(errno.ENOSYS)
        self._check(inode)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise _erofs()
        if self.tree.kind[inode - 1] != KIND_FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if self.tree.is_dir(inode) else errno.EINVAL)
        # The inode is the handle: read-only files need no per-open state.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        # fh is the inode: our handle from open(), or put there by the shim (no OPEN).
        i = fh - 1
        tree = self.tree
        try:
            if tree.sparse and i in tree.sparse:  # holes read as zeros (rare: a dict lookup)
                return await read_sparse(self.reader, tree.file_ref(fh), tree.sparse[i], off,
                                         size)
            if tree.packed and i in tree.packed:  # compressed: decoded whole (a dict lookup)
                return await self.packed.read(self.reader, tree.file_ref(fh), tree.packed[i],
                                              off, size)
            shard = tree.shard[i]
            data = await self.reader.read(shard, tree.offset[i], tree.size[i], off, size)
            if self.fast is not None:
                self.fast.offer(shard)  # complete now? the next reads of it need no Python
            return data
        except ReadError as exc:
            log.error("EIO for %s: %s", self.tree.path(fh).decode(errors="replace"), exc)
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def release(self, fh):
        return None  # handles carry no state (fh is the inode)

    # No flush handler on purpose: pyfuse3 answers ENOSYS, after which the kernel stops
    # sending FLUSH on every close() — one round trip per file less.

    # -- extended attributes ---------------------------------------------------------------
    def _dir_pages(self, inode: int) -> list[bytes]:
        """A directory's file -> shard pages (see dirmap)."""
        pages = self._pages.get(inode)
        if pages is None:
            tree = self.tree
            files = ((tree.name(c), self.shard_urls[tree.shard[c - 1]])
                     for c in tree.list_dir(inode) if tree.kind[c - 1] == KIND_FILE)
            pages = self._pages[inode] = encode_pages(files)
        return pages

    def _xattr_names(self, inode: int) -> list[bytes]:
        kind = self.tree.kind[inode - 1]
        if kind == KIND_FILE:
            packed = self.tree.packed and inode - 1 in self.tree.packed
            return list(FILE_XATTRS + PACKED_XATTRS) if packed else list(FILE_XATTRS)
        names = []
        if inode == pyfuse3.ROOT_INODE and self.stats_json is not None:
            names.append(STATS_XATTR)
        if kind == KIND_DIR:
            names += [PAGE_PREFIX + str(i).encode() for i in range(len(self._dir_pages(inode)))]
        return names

    def _xattr_value(self, inode: int, name: bytes) -> bytes | None:
        tree = self.tree
        kind = tree.kind[inode - 1]
        if kind == KIND_FILE and name in FILE_XATTRS:
            ref = tree.file_ref(inode)
            if name == FILE_XATTRS[0]:
                return self.shard_urls[ref.shard].encode("utf-8", "surrogateescape")
            return str(ref.offset if name == FILE_XATTRS[1] else ref.size).encode()
        if kind == KIND_FILE and name in PACKED_XATTRS and inode - 1 in tree.packed:
            codec, stored, _ = tree.packed[inode - 1]
            return codec.encode() if name == PACKED_XATTRS[0] else str(stored).encode()
        if kind == KIND_DIR and name.startswith(PAGE_PREFIX):
            page = name[len(PAGE_PREFIX):]
            pages = self._dir_pages(inode)
            if page.isdigit() and int(page) < len(pages):
                return pages[int(page)]
        return None

    async def getxattr(self, inode, name, ctx):
        self._check(inode)
        if name == STATS_XATTR and inode == pyfuse3.ROOT_INODE and self.stats_json is not None:
            return await self.stats_json()
        value = self._xattr_value(inode, name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def listxattr(self, inode, ctx):
        self._check(inode)
        return self._xattr_names(inode)

    # -- everything that would modify the tree: read-only filesystem -----------------------
    async def setattr(self, inode, attr, fields, fh, ctx):
        raise _erofs()

    async def setxattr(self, inode, name, value, ctx):
        raise _erofs()

    async def removexattr(self, inode, name, ctx):
        raise _erofs()

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise _erofs()

    async def mkdir(self, parent_inode, name, mode, ctx):
        raise _erofs()

    async def unlink(self, parent_inode, name, ctx):
        raise _erofs()

    async def rmdir(self, parent_inode, name, ctx):
        raise _erofs()

    async def symlink(self, parent_inode, name, target, ctx):
        raise _erofs()

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        raise _erofs()

    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise _erofs()

    async def write(self, fh, off, buf):
        raise _erofs()

    async def create(self, parent_inode, name, mode, flags, ctx):
        raise _erofs()
