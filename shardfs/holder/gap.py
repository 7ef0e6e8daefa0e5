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
import logging
import os
import struct

log = logging.getLogger("shardfs.holder")

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


class Gap:
    """The time without a daemon serving the mount: past the deadline, a Refuser answers its
    requests with EIO (while nobody else may read the connection)."""

    def __init__(self, fuse_fd: int, started: float, deadline_s: float,
                 mountpoint: str) -> None:
        self.fuse_fd = fuse_fd
        self.started = started
        self.deadline_s = deadline_s
        self.mountpoint = mountpoint
        self.refuser: Refuser | None = None
        self.failed = 0  # requests answered with EIO in this gap
        self.said = False

    def due_in(self, now: float) -> float:
        """Seconds until refusing is due (inf once it is, or while it runs)."""
        left = self.started + self.deadline_s - now
        return left if left > 0 and self.refuser is None else float("inf")

    def fds(self) -> list[int]:
        return [self.refuser.fd] if self.refuser is not None else []

    def refuse_if_due(self, now: float) -> None:
        if self.refuser is not None or now - self.started < self.deadline_s:
            return
        if not self.said:
            self.said = True
            log.error("no daemon has served %s for %.1f s (its --deadline is %g s): failing "
                      "its reads with EIO until a new daemon serves", self.mountpoint,
                      now - self.started, self.deadline_s)
        try:
            self.refuser = Refuser(self.fuse_fd)
        except OSError as exc:
            self._give_up_refusing(exc)
            return
        self.answer([self.refuser.fd])

    def answer(self, readable: list[int]) -> None:
        """Fail what is queued if the clone is readable; ConnectionEnded passes through."""
        if self.refuser is None or self.refuser.fd not in readable:
            return
        try:
            self.refuser.answer_queued()
        except OSError as exc:  # never the holder's end: the mount outlives this
            self._give_up_refusing(exc)

    def _give_up_refusing(self, exc: OSError) -> None:
        log.error("cannot answer the mount's requests (%s): they wait for the next daemon",
                  exc)
        self.stop("an error")
        self.deadline_s = float("inf")

    def stop(self, why: str) -> None:
        """Stop reading the connection (before a new daemon touches it)."""
        if self.refuser is not None:
            self.failed += self.refuser.close()
            self.refuser = None
            log.warning("stopped failing reads (%s): %d requests failed with EIO while no "
                        "daemon served", why, self.failed)
