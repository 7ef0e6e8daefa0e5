"""A tiny FUSE filesystem that is not shardfs, for tests that must tell the two apart.

    python tests/otherfs.py MOUNTPOINT      # mounts as fuse.otherfs; exits once unmounted

One read-only file, `hello.txt`. It is mounted with its own FUSE subtype (`fuse.otherfs` in
/proc/mounts) through pyfuse3, as any other FUSE filesystem would be. A lookup of `stall` is
never answered (until the filesystem is unmounted): a process whose thread looks it up waits
in the kernel, as a daemon's thread waits on its own mount when nobody serves it
(`OTHERFS_STALL_MARK=PATH`: the file written when such a lookup arrives).
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio

NAME = b"hello.txt"
STALL = b"stall"
DATA = b"not shardfs\n"
FSTYPE = "fuse.otherfs"


class OtherFS(pyfuse3.Operations):
    FILE = pyfuse3.ROOT_INODE + 1

    async def getattr(self, inode: int, ctx: object = None) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            entry.st_mode, entry.st_size = stat.S_IFDIR | 0o755, 0
        elif inode == self.FILE:
            entry.st_mode, entry.st_size = stat.S_IFREG | 0o444, len(DATA)
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        entry.st_ino = inode
        entry.st_uid, entry.st_gid = os.getuid(), os.getgid()
        return entry

    async def lookup(self, parent_inode: int, name: bytes, ctx: object = None
                     ) -> pyfuse3.EntryAttributes:
        if parent_inode == pyfuse3.ROOT_INODE and name == STALL:
            mark = os.environ.get("OTHERFS_STALL_MARK")
            if mark:  # tells a test that the lookup arrived (and will never be answered)
                with open(mark, "w") as f:
                    f.write(str(ctx.pid) if ctx is not None else "?")
            await trio.sleep_forever()
        if parent_inode != pyfuse3.ROOT_INODE or name != NAME:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(self.FILE)

    async def opendir(self, inode: int, ctx: object) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: object) -> None:
        if start_id == 0:
            pyfuse3.readdir_reply(token, NAME, await self.getattr(self.FILE), 1)

    async def open(self, inode: int, flags: int, ctx: object) -> pyfuse3.FileInfo:
        if inode != self.FILE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        return DATA[off : off + size]


def main(mountpoint: str) -> None:
    options = set(pyfuse3.default_options) | {"fsname=otherfs", "subtype=otherfs", "ro"}
    pyfuse3.init(OtherFS(), mountpoint, options)
    try:
        trio.run(pyfuse3.main)  # returns once the filesystem is unmounted
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main(sys.argv[1])
