"""A FUSE worker process: one more reader of the mount's FUSE connection.

Forked (by the daemon's zygote) after the daemon mounted and answered INIT, so the worker
inherits pyfuse3's initialised session and the Operations object. It then gives itself its own
descriptor of the connection — `/dev/fuse` opened again and cloned with FUSE_DEV_IOC_CLONE,
made non-blocking and put in place of the session's descriptor — and runs pyfuse3's loop on
it. The kernel hands each request to whichever worker reads first; a reply goes back on the
descriptor its request came from, and closing one clone (a worker dying) ends only that
worker's unanswered requests. Non-blocking matters: every worker is woken for each request
and all but one find nothing (EAGAIN), which our shim turns into "wait again".
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import struct
from dataclasses import dataclass
from pathlib import Path

import trio

from shardfs.fuse import session as fuse_session
from shardfs.fuse import shim
from shardfs.fuse.fastread import FastReads
from shardfs.fuse.ops import ShardFS
from shardfs.fuse.remote import RemoteReader
from shardfs.read.states import ShardStates
from shardfs.util.rpc import Caller, Channel

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


def clone_session_fd() -> None:
    """Replace the session's /dev/fuse descriptor, in this process, by a non-blocking clone."""
    session_fd = shim.session_fd()
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, FUSE_DEV_IOC_CLONE, struct.pack("I", session_fd))
        os.set_blocking(fd, False)
        os.dup2(fd, session_fd, inheritable=False)
    finally:
        os.close(fd)


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

    async def stats_json() -> bytes:
        return (await caller.call("stats"))[1]

    ops.stats_json = stats_json
    async with trio.open_nursery() as nursery:
        async def until_daemon_gone() -> None:
            await caller.dispatch()  # ends when the daemon closes the connection
            nursery.cancel_scope.cancel()

        nursery.start_soon(until_daemon_gone)
        nursery.start_soon(reader.report)
        await caller.notify("hello", os.getpid())
        await fuse_session.serve(setup.max_tasks)  # ends when the mount goes away
        nursery.cancel_scope.cancel()


def run_worker(setup: WorkerSetup) -> int:
    """The body of a forked worker process; returns its exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        clone_session_fd()
        trio.run(_serve, setup)
    except Exception:
        log.exception("FUSE worker %d failed", os.getpid())
        return 1
    return 0
