"""A FUSE worker process: one more reader of the mount's FUSE connection.

Forked (by the daemon's zygote) after the daemon mounted and answered INIT, so the worker
inherits pyfuse3's initialised session and the Operations object. The zygote gives each worker
its own descriptor of the connection — `/dev/fuse` opened again and cloned with
FUSE_DEV_IOC_CLONE — and keeps a copy of it; the worker makes it non-blocking, puts it in place
of the session's descriptor and runs pyfuse3's loop on it. The kernel hands each request to
whichever worker reads first; a reply goes back on the descriptor its request came from.
Non-blocking matters: every worker is woken for each request and all but one find nothing
(EAGAIN), which our shim turns into "wait again".

When a worker dies, the zygote's copy keeps its clone open, so the requests it had read but not
answered stay queued on that clone instead of being ended with ECONNABORTED; the zygote then
writes FUSE_NOTIFY_RESEND (Linux >= 6.9), which puts every read-but-unanswered request of the
connection back in the queue for the live workers, and closes its copy (docs/design.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import signal
import struct
from dataclasses import dataclass
from pathlib import Path

import trio

from shardfs.fuse import session as fuse_session
from shardfs.fuse import shim
from shardfs.fuse.fastread import FastReads
from shardfs.fuse.ops import ShardFS
from shardfs.fuse.remote import RemoteReader, daemon_gone
from shardfs.read.states import ShardStates
from shardfs.util.gcfreeze import freeze_startup_objects
from shardfs.util.rpc import Caller, Channel, ChannelClosed

log = logging.getLogger(__name__)

FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t), include/uapi/linux/fuse.h


@dataclass
class WorkerSetup:
    """What a worker needs, all inherited through fork."""

    ops: ShardFS
    states: ShardStates
    shards_dir: Path
    keys: list[str]
    dataset_bytes: int
    daemon_address: str  # the daemon's worker socket (abstract namespace, no leading NUL)
    max_tasks: int


FUSE_NOTIFY_RESEND = 7  # enum fuse_notify_code, include/uapi/linux/fuse.h (Linux >= 6.9)


def clone_connection() -> int:
    """A new descriptor of the session's FUSE connection, with its own queue of read requests."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", shim.session_fd()))
    except BaseException:
        os.close(fd)
        raise
    return fd


def serve_on(clone_fd: int) -> None:
    """Make `clone_fd` (from clone_connection) this process's session descriptor, non-blocking."""
    os.set_blocking(clone_fd, False)
    os.dup2(clone_fd, shim.session_fd(), inheritable=False)
    os.close(clone_fd)


def resend_unanswered(fd: int) -> None:
    """Have the kernel queue again every request of the connection that a reader of any of its
    descriptors took but has not answered (a notification: fuse_out_header, unique 0, the code
    in the error field). A late answer to an original then fails with ENOENT, so each request
    is answered once. OSError(EINVAL) where the kernel has no FUSE_NOTIFY_RESEND."""
    os.write(fd, struct.pack("=IiQ", 16, FUSE_NOTIFY_RESEND, 0))


def fuse_session_alive() -> bool:
    """Whether the connection is still there: the kernel flags a /dev/fuse descriptor with
    POLLERR once its connection has ended (unmounted or aborted)."""
    poller = select.poll()
    poller.register(shim.session_fd(), select.POLLIN)
    return not any(event & select.POLLERR for _, event in poller.poll(0))


async def _serve(setup: WorkerSetup) -> None:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.connect("\0" + setup.daemon_address)
    caller = Caller(Channel(trio.SocketStream(sock)))
    reader = RemoteReader(caller, setup.states, setup.shards_dir, setup.keys,
                          setup.dataset_bytes)
    caller.on_message = reader.on_message
    ops = setup.ops
    ops.reader = reader
    ops.fast = reader.fast = FastReads(setup.states, setup.shards_dir, setup.keys)
    reader.opens = lambda: ops.opens
    reader.ioctls = shim.ioctls_answered
    reader.fuse_requests = shim.reader_counts

    async def stats_json() -> bytes:
        return (await caller.call("stats"))[1]

    ops.stats_json = stats_json
    async with trio.open_nursery() as nursery:
        async def until_daemon_gone() -> None:
            with contextlib.suppress(ChannelClosed):
                await caller.dispatch()  # ends when the daemon closes the connection
            if fuse_session_alive():
                daemon_gone()  # answer nothing: a new daemon may take the mount over
            nursery.cancel_scope.cancel()

        nursery.start_soon(until_daemon_gone)
        nursery.start_soon(reader.report)
        await caller.notify("hello", os.getpid())
        freeze_startup_objects()  # what the zygote and this process built stays: see gcfreeze
        await fuse_session.serve(setup.max_tasks)  # ends when the mount goes away
        nursery.cancel_scope.cancel()


def not_a_late_answer(record: logging.LogRecord) -> bool:
    """pyfuse3 logs an error when the kernel refuses an answer with ENOENT: the request was
    queued again after a worker died (resend_unanswered) and its new copy is answered instead,
    or it was interrupted. Expected, not an error: keep such records out of the log."""
    return not ("fuse_reply_" in str(record.msg)
                and record.getMessage().endswith("failed with " + os.strerror(errno.ENOENT)))


def run_worker(setup: WorkerSetup, clone_fd: int) -> int:
    """The body of a forked worker process, serving on `clone_fd` (from clone_connection);
    returns its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    logging.getLogger("pyfuse3").addFilter(not_a_late_answer)
    try:
        serve_on(clone_fd)
        trio.run(_serve, setup)
    except Exception:
        log.exception("FUSE worker %d failed", os.getpid())
        return 1
    return 0
