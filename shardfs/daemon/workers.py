"""FUSE worker processes, seen from the daemon: forking them, serving their requests, replacing
the ones that die.

Process layout with `--workers N` (N > 1):

    daemon (supervisor)   owns the mount, network, cache budget, eviction, control socket;
    │                     never reads FUSE requests itself
    └── zygote            forked right after INIT, before the daemon starts any thread;
        ├── worker 1      forks a worker whenever the daemon asks (at start, and to replace
        ├── ...           one that died), so workers never come from a threaded process
        └── worker N      each serves FUSE requests on its own clone of the connection

Workers connect to the daemon's worker socket (abstract namespace; only the zygote's children
are served) and send
`read` calls for bytes not yet on disk plus batched notes of the reads they served themselves.

The zygote clones the FUSE connection for each worker and holds a copy of that descriptor
until the worker has exited, so that a killed worker's unanswered requests are not ended (with
ECONNABORTED) but queued again for the others (FUSE_NOTIFY_RESEND; docs/design.md, Workers).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from shardfs.daemon.control import peer_credentials, uid_allowed
from shardfs.fuse.worker import clone_connection, resend_unanswered
from shardfs.read.reader import Reader, ReadError
from shardfs.util.rpc import Channel, ChannelClosed

log = logging.getLogger(__name__)


def _parent_of(pid: int) -> int | None:
    """The parent pid of a live process (from /proc), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[1])  # the name may hold spaces and ')'


def worker_address(control_address: str, daemon_pid: int) -> str:
    """The workers' socket, beside the control socket (printable form without the '@'). One
    per daemon process: a killed daemon that lingers (docs/design.md, "A daemon that cannot
    finish dying") holds its own until the next daemon's workers answer what it waits on."""
    return control_address.lstrip("@") + f"/workers.{daemon_pid}"


class Zygote:
    """A small forked process that forks FUSE workers on request."""

    def __init__(self, run_worker: Callable[[int], int], *, keep_fds: tuple[int, ...],
                 log_path: str | None) -> None:
        self._run_worker = run_worker  # called in the worker with its clone of the connection
        self._keep_fds = keep_fds  # all other descriptors are closed in the zygote
        self._log_path = log_path  # where stdout/stderr go once the daemon has detached
        self.pid = 0
        self._cmd_w = -1
        self._pid_r = -1

    def start(self) -> None:
        cmd_r, cmd_w = os.pipe()
        pid_r, pid_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote
            try:
                os.close(cmd_w)
                os.close(pid_r)
                self._serve(cmd_r, pid_w)
            finally:
                os._exit(0)
        os.close(cmd_r)
        os.close(pid_w)
        self.pid, self._cmd_w, self._pid_r = pid, cmd_w, pid_r

    def _detach_fds(self, cmd_r: int, pid_w: int) -> None:
        """Keep only what workers need: not the readiness pipe (the `shardfs mount` parent
        waits for its end of file), the cache lock, or the caller's terminal once detached."""
        keep = {0, 1, 2, cmd_r, pid_w, *self._keep_fds}
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self._log_path is not None:
            null = os.open(os.devnull, os.O_RDONLY)
            log_fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(null)
            os.close(log_fd)

    def _serve(self, cmd_r: int, pid_w: int) -> None:
        self._detach_fds(cmd_r, pid_w)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        held = HeldClones()
        # Workers are reaped once their clone is let go, or else automatically.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL if held.can_hold else signal.SIG_IGN)
        if not held.can_hold:
            log.warning("no pidfd_open (Linux < 5.3): a read a killed worker was answering "
                        "fails once with ECONNABORTED")
        children: list[int] = []
        poll = select.poll()
        poll.register(cmd_r, select.POLLIN)
        try:
            while True:
                for fd, _ in poll.poll():
                    if fd != cmd_r:
                        poll.unregister(fd)
                        children.remove(held.exited(fd))
                    elif not os.read(cmd_r, 1):  # one byte per worker wanted; end of file: stop
                        return
                    else:
                        pid, pidfd = self._fork_worker(cmd_r, pid_w, held)
                        if pid:
                            children.append(pid)
                        if pidfd >= 0:
                            poll.register(pidfd, select.POLLIN)
                        os.write(pid_w, struct.pack("i", pid))
        finally:
            # The daemon is gone or done: so are its workers. Killed, not asked: a worker must
            # not answer the reads it holds with an error. Only once they are dead are their
            # requests queued again (a new daemon may take the mount over) and their clones
            # let go.
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            held.release_all()

    def _fork_worker(self, cmd_r: int, pid_w: int, held: HeldClones) -> tuple[int, int]:
        """Fork a worker serving on a new clone of the connection; (pid, its pidfd or -1).
        (0, -1) when the connection cannot be cloned (the mount is going away)."""
        try:
            clone = clone_connection()
        except OSError as exc:
            log.warning("cannot clone the FUSE connection for a new worker: %s", exc)
            return 0, -1
        child = os.fork()
        if child == 0:
            status = 1
            try:
                os.close(cmd_r)
                os.close(pid_w)
                held.close()  # the other workers' clones are the zygote's to hold
                status = self._run_worker(clone)
            finally:
                os._exit(status)
        return child, held.hold(child, clone)

    async def spawn(self) -> int:
        """Fork one more worker; its pid."""
        os.write(self._cmd_w, b"w")
        data = await trio.to_thread.run_sync(os.read, self._pid_r, 4)
        if len(data) != 4:
            raise RuntimeError("the worker zygote exited")
        return struct.unpack("i", data)[0]

    def stop(self) -> None:
        """Ask the zygote to stop its workers and exit; reap it."""
        if self._cmd_w >= 0:
            os.close(self._cmd_w)
            os.close(self._pid_r)
            self._cmd_w = self._pid_r = -1
        if self.pid:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = 0


class HeldClones:
    """The zygote's copies of its workers' clones of the FUSE connection, one per live worker.

    The kernel ends a clone's read-but-unanswered requests (ECONNABORTED) only when the clone's
    last descriptor closes. Holding a copy lets the zygote, once a worker has exited (its pidfd
    is readable), first queue those requests again for the others (FUSE_NOTIFY_RESEND), then
    close the copy with nothing left on it. Without pidfds (Linux < 5.3) nothing is held."""

    def __init__(self) -> None:
        self._by_pidfd: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, clone)
        self.resend_supported: bool | None = None  # None until a worker has exited
        try:
            os.close(os.pidfd_open(os.getpid()))
            self.can_hold = True
        except OSError:
            self.can_hold = False

    def hold(self, pid: int, clone: int) -> int:
        """Keep `clone`, forked into worker `pid`; the worker's pidfd, or -1 (nothing held)."""
        if not self.can_hold:
            os.close(clone)
            return -1
        pidfd = os.pidfd_open(pid)
        self._by_pidfd[pidfd] = (pid, clone)
        return pidfd

    def exited(self, pidfd: int) -> int:
        """The worker of `pidfd` has exited: requeue its unanswered requests, reap it, let go
        of its clone; its pid."""
        pid, clone = self._by_pidfd.pop(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        if self.resend_supported is not False:
            try:
                resend_unanswered(clone)
                self.resend_supported = True
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    self.resend_supported = False
                    log.warning("this kernel has no FUSE_NOTIFY_RESEND (Linux < 6.9): a read a "
                                "killed worker was answering fails once with ECONNABORTED")
                # else the connection is gone (unmounted): nothing to requeue
        os.close(clone)
        os.close(pidfd)
        return pid

    def release_all(self) -> None:
        """Every worker has been killed: wait until each has exited, then queue their
        unanswered requests again and let go of the clones."""
        for pidfd in list(self._by_pidfd):
            select.select([pidfd], [], [], 5.0)
            self.exited(pidfd)

    def close(self) -> None:
        for pidfd, (_, clone) in self._by_pidfd.items():
            os.close(clone)
            os.close(pidfd)
        self._by_pidfd.clear()


class WorkerPool:
    """The daemon's side of its workers: keeps `count` of them serving while mounted."""

    def __init__(self, zygote: Zygote, count: int, reader: Reader, address: str,
                 stats_json: Callable[[], Any], still_mounted: Callable[[], bool]) -> None:
        self.zygote = zygote
        self.count = count
        self.reader = reader
        self.address = address
        self.stats_json = stats_json
        self.still_mounted = still_mounted
        self.serving: dict[int, Channel] = {}  # workers that said hello, in order
        self._flush_seq = 0
        self._flushed: dict[int, trio.Event] = {}  # pid -> set when its notes are in
        self.restarts = 0
        self.opens = 0  # OPEN requests the workers answered
        self.ioctls = 0  # IOCTL requests their shims answered
        self.fuse_requests = [0, 0]  # their reader threads': answered in C, handed to pyfuse3
        self._all_serving = trio.Event()
        self._sharing: set[Channel] = set()  # workers that map the lookahead arena
        self._unmounted = trio.Event()
        self._calls: trio.Nursery  # run()'s: answers to the workers' calls

    @property
    def pids(self) -> list[int]:
        return list(self.serving)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Listen, start the workers, and return (via task_status) once all of them serve.
        Keeps replacing workers that die; returns when the mount went away."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind("\0" + self.address)
        sock.listen(64)
        async with trio.open_nursery() as nursery:
            self._calls = nursery
            nursery.start_soon(self._accept, sock, nursery)
            nursery.start_soon(self._publish_lookahead)
            for _ in range(self.count):
                await self.zygote.spawn()
            await self._all_serving.wait()
            task_status.started()
            await self._unmounted.wait()
            nursery.cancel_scope.cancel()

    async def _accept(self, sock: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            conn, _ = await sock.accept()
            # Only the zygote's children are workers: another process of the same user that
            # connects (and leaves) must not count as a worker, nor its leaving as a death.
            pid, uid = peer_credentials(conn)  # type: ignore[arg-type]
            if _parent_of(pid) != self.zygote.pid or not uid_allowed(uid):
                conn.close()
                continue
            nursery.start_soon(self._serve_worker, Channel(trio.SocketStream(conn)))

    async def _serve_worker(self, channel: Channel) -> None:
        pid = None
        try:
            while True:
                message = await channel.receive()
                if message[0] == "call":
                    # In the pool's nursery: a dead worker's reads are not cancelled. The
                    # kernel gives its requests to the other workers, which ask for the same
                    # bytes; cancelling would fail the member reads they share
                    # (Reader._block) with "fetch did not complete".
                    self._calls.start_soon(self._answer, channel, message[1], message[2:])
                elif message[1] == "reads":
                    self._note_reads(pid, *message[2:])
                elif message[1] == "taken" and self.reader.lookahead is not None:
                    for taken in message[2]:
                        self.reader.lookahead.taken(*taken)
                elif message[1] == "flushed":
                    if message[2] == self._flush_seq and pid in self._flushed:
                        self._flushed[pid].set()
                elif message[1] == "hello":
                    pid = message[2]
                    self.serving[pid] = channel
                    await self._share_lookahead(channel)
                    log.info("FUSE worker %d serving (%d of %d)", pid,
                             len(self.serving), self.count)
                    if len(self.serving) >= self.count:
                        self._all_serving.set()
        except ChannelClosed:
            pass
        finally:
            self._sharing.discard(channel)
            if pid is not None:
                self.serving.pop(pid, None)
                flushed = self._flushed.pop(pid, None)
                if flushed is not None:
                    flushed.set()
            await channel.aclose()
            await self._worker_gone(pid)

    async def _share_lookahead(self, channel: Channel) -> None:
        """Give a worker the lookahead arena (once there is one), so that it serves announced
        members itself."""
        arena = self.reader.lookahead.arena if self.reader.lookahead is not None else None
        if arena is not None and channel not in self._sharing:
            self._sharing.add(channel)
            with contextlib.suppress(ChannelClosed):
                await channel.send(("arena", arena.path, arena.total, arena.size))

    async def _publish_lookahead(self) -> None:
        """Make the lookahead arena when a training process first announces, and tell the
        workers where it is, which members landed in it and which left it."""
        lookahead = self.reader.lookahead
        if lookahead is None:
            return
        while True:
            await lookahead.published.wait()
            lookahead.published = trio.Event()
            if lookahead.arena is None and lookahead.stats.connections:
                lookahead.share()
            for channel in list(self.serving.values()):
                await self._share_lookahead(channel)
            if not (lookahead.landed or lookahead.gone):
                continue
            message = ("lookahead", lookahead.landed, lookahead.gone)
            lookahead.landed, lookahead.gone = [], []
            for channel in list(self._sharing):
                with contextlib.suppress(ChannelClosed):
                    await channel.send(message)

    async def flush(self, timeout: float = 5.0) -> None:
        """Have every worker send the notes of the reads it served so far (so that stats
        count them); gives up on a worker after `timeout`."""
        self._flush_seq += 1
        self._flushed = {pid: trio.Event() for pid in self.serving}
        for channel in list(self.serving.values()):
            with contextlib.suppress(ChannelClosed):
                await channel.send(("flush", self._flush_seq))
        with trio.move_on_after(timeout):
            for event in list(self._flushed.values()):
                await event.wait()

    def _note_reads(self, pid: int | None, shards: list[int], nbytes: int, cache_hits: int,
                    frontier_hits: int, inline: int, threaded: int, in_c: int,
                    opens: int, ioctls: int, requests_in_c: int, requests_to_python: int
                    ) -> None:
        self.reader.note_reads(("worker", pid), shards, nbytes, cache_hits, frontier_hits)
        self.opens += opens
        self.ioctls += ioctls
        self.fuse_requests[0] += requests_in_c
        self.fuse_requests[1] += requests_to_python
        self.reader.disk.inline += inline
        self.reader.disk.threaded += threaded
        self.reader.disk.in_c += in_c

    async def _answer(self, channel: Channel, rid: int, request: tuple) -> None:
        answer: tuple
        if request[0] == "read":
            shard, member_off, member_size, off, size, want_bytes = request[1:]
            try:
                if want_bytes:
                    data = await self.reader.read(shard, member_off, member_size, off, size)
                else:
                    data = await self.reader.read_or_locate(shard, member_off, member_size,
                                                            off, size)
                answer = ("disk",) if data is None else ("data", bytes(data))
            except ReadError as exc:
                answer = ("eio", str(exc))
            except Exception as exc:  # never let one request take the daemon down
                log.exception("answering a worker's read failed")
                answer = ("eio", f"{type(exc).__name__}: {exc}")
        elif request[0] == "stats":
            answer = ("data", await self.stats_json())
        else:
            answer = ("eio", f"unknown request {request[0]!r}")
        with contextlib.suppress(ChannelClosed):
            await channel.send(("answer", rid, answer))

    async def _worker_gone(self, pid: int | None) -> None:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a worker without its connection is no use
        if not self.still_mounted():
            log.info("the mount was unmounted (shardfs umount, fusermount3 -u or umount; "
                     "worker %s ended)", pid)
            self._unmounted.set()
            return
        log.warning("FUSE worker %s exited; starting another", pid)
        self.restarts += 1
        with contextlib.suppress(RuntimeError):
            await self.zygote.spawn()
