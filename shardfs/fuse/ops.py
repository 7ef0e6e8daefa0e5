"""pyfuse3 Operations: translates FUSE requests to tree lookups and reader calls; no policy.

Metadata never touches the network: the tree is in memory and immutable, so entries and
attributes get long kernel timeouts and readdir (always readdirplus in pyfuse3) carries full
attributes. Files are opened with keep_cache so the page cache absorbs repeated reads.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

import pyfuse3
from cachetools import LRUCache

from shardfs.catalog.dirmap import PREFIX as PAGE_PREFIX
from shardfs.catalog.dirmap import encode_pages
from shardfs.catalog.shardindex import KIND_DIR, KIND_FILE, KIND_LINK
from shardfs.catalog.tree import Tree
from shardfs.read.reader import Reader, ReadError
from shardfs.read.sparse import read_sparse

log = logging.getLogger(__name__)

TIMEOUT = 24 * 3600.0  # seconds; the data is immutable for the life of the mount
XATTR_PREFIX = b"user.shardfs."
FILE_XATTRS = (b"user.shardfs.shard", b"user.shardfs.offset", b"user.shardfs.size")
STATS_XATTR = b"user.shardfs.stats"  # on the root: JSON counters, read by `shardfs stats`


def _erofs() -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(errno.EROFS)


class ShardFS(pyfuse3.Operations):
    def __init__(self, tree: Tree, reader: Reader, shard_urls: list[str], *, uid: int,
                 gid: int, stats_json: Callable[[], bytes] | None = None) -> None:
        super().__init__()
        self.tree = tree
        self.reader = reader
        self.shard_urls = shard_urls
        self.uid = uid
        self.gid = gid
        self.stats_json = stats_json
        # Directory inode -> its file->shard xattr pages. Readers go one directory at a time
        # (listxattr, then each page), so a few entries suffice and memory stays flat.
        self._pages: LRUCache = LRUCache(maxsize=8)

    # -- metadata --------------------------------------------------------------------------
    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        tree = self.tree
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ino
        attr.generation = 0
        attr.entry_timeout = TIMEOUT
        attr.attr_timeout = TIMEOUT
        attr.st_mode = tree.st_mode(ino)
        attr.st_nlink = 1
        attr.st_uid = self.uid
        attr.st_gid = self.gid
        size = tree.st_size(ino)
        attr.st_size = size
        attr.st_blksize = 1 << 17
        attr.st_blocks = (size + 511) // 512
        mtime_ns = tree.mtime[ino - 1] * 1_000_000_000
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
        # Positions in the (immutable) child list are the stable readdir offsets.
        tree = self.tree
        for pos, child in enumerate(tree.list_dir(fh, start_id), start=start_id):
            if not pyfuse3.readdir_reply(token, tree.name(child), self._attr(child), pos + 1):
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
        self._check(inode)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & (os.O_TRUNC | os.O_APPEND):
            raise _erofs()
        if self.tree.kind[inode - 1] != KIND_FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if self.tree.is_dir(inode) else errno.EINVAL)
        # The inode is the handle: read-only files need no per-open state.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        ref = self.tree.file_ref(fh)
        try:
            if self.tree.sparse and fh - 1 in self.tree.sparse:  # holes read as zeros
                return await read_sparse(self.reader, ref, self.tree.sparse[fh - 1], off, size)
            return await self.reader.read(ref.shard, ref.offset, ref.size, off, size)
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
            return list(FILE_XATTRS)
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
        if name == STATS_XATTR and inode == pyfuse3.ROOT_INODE and self.stats_json is not None:
            return self.stats_json()
        if kind == KIND_DIR and name.startswith(PAGE_PREFIX):
            page = name[len(PAGE_PREFIX):]
            pages = self._dir_pages(inode)
            if page.isdigit() and int(page) < len(pages):
                return pages[int(page)]
        return None

    async def getxattr(self, inode, name, ctx):
        self._check(inode)
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
