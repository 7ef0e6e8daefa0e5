"""Failing a mount's requests with EIO while no daemon serves it, once the gap has lasted the
mount's --deadline (docs/design.md, "A mount that outlives its daemon": "Reads during the gap").

The holder opens a clone of the connection (its own descriptor, non-blocking, with its own
list of requests read: closing it ends nothing of the daemons'), asks the kernel to queue again
whatever a dead daemon had read and not answered (FUSE_NOTIFY_RESEND), then reads each queued
request and answers it with -EIO. Only the wire format is used: fuse_in_header / fuse_out_header
and the opcodes, from the kernel's include/uapi/linux/fuse.h. Stdlib only (the holder is tiny).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct

# fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
IN_HEADER = struct.Struct("=IIQQIIIHH")
OUT_HEADER = struct.Struct("=IiQ")  # fuse_out_header: len, error, unique
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
FUSE_NOTIFY_RESEND = 7  # enum fuse_notify_code (Linux >= 6.9)
# Requests the kernel expects no answer to: FORGET, INTERRUPT, NOTIFY_REPLY, BATCH_FORGET.
NO_REPLY = frozenset((2, 36, 41, 42))
# A read must offer room for the largest request (a WRITE of max_write bytes) or the kernel
# refuses it with EINVAL before taking anything off the queue: start at 1 MiB + headers (256
# pages, the usual max_pages) and grow when refused.
FIRST_BUFFER = (1 << 20) + 8192
LARGEST_BUFFER = 64 << 20


class ConnectionEnded(Exception):
    """The connection is gone (unmounted or aborted): nothing is waiting any more."""


class Refuser:
    """A clone of the connection that answers every request queued on it with EIO."""

    def __init__(self, fuse_fd: int) -> None:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", fuse_fd))
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.failed = 0  # requests answered with EIO
        self._buffer = bytearray(FIRST_BUFFER)
        # What a dead daemon (or a takeover killed mid-way) had read waits on its list, not in
        # the queue: back to the queue with it, where this clone reads it.
        with contextlib.suppress(OSError):
            os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, FUSE_NOTIFY_RESEND, 0))

    def answer_queued(self) -> None:
        """Read and fail every request queued now; ConnectionEnded if the connection ended."""
        while True:
            try:
                size = os.readv(self.fd, [self._buffer])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINVAL and len(self._buffer) < LARGEST_BUFFER:
                    self._buffer = bytearray(len(self._buffer) * 2)
                    continue
                if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                    raise ConnectionEnded from None
                raise
            if size < IN_HEADER.size:
                continue
            _, opcode, unique, *_ = IN_HEADER.unpack_from(self._buffer)
            if opcode in NO_REPLY:
                continue
            try:
                os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique))
            except OSError as exc:
                if exc.errno in (errno.ENODEV, errno.ECONNABORTED):
                    raise ConnectionEnded from None
                if exc.errno != errno.ENOENT:  # ENOENT: interrupted and ended meanwhile
                    raise
                continue
            self.failed += 1

    def close(self) -> int:
        """Let go of the clone (every request it read is answered); how many were failed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._buffer = bytearray()
        return self.failed
