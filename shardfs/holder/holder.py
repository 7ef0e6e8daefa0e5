"""The holder process (`python -m shardfs.holder`), started by a daemonizing `shardfs mount`.

    shardfs mount (waits)        holder  ── keeps a duplicate of the FUSE descriptor
                                 ├── daemon      `shardfs mount ... -f` (mounts, serves)
                                 └── spare       `... --fuse-fd N --takeover --standby-fd S`:
                                                 imported, waiting to take over

The first daemon mounts as always and, once INIT is answered, sends the holder a duplicate of
its descriptor (shardfs/daemon/handover.py). When the daemon dies, the connection stays alive
in the holder: readers' requests wait in the kernel. The holder says "go" to the spare (a
daemon already started and imported, so the gap is not spent starting Python), which takes
the mount over; then it starts the next spare. `shardfs restart` (SIGUSR1 to the holder)
starts a fresh spare with the code installed now, and once it stands by, has the daemon exit
without unmounting (SIGUSR1) and the spare take over.

The daemon stopping by itself (status 0: SIGTERM, `shardfs umount`, `fusermount3 -u`) ends
the holder, which unmounts if the mount is still there. SIGTERM/SIGINT/SIGHUP to the holder
stop the daemon the same way. A daemon that keeps dying is not restarted forever: after
MAX_DEATHS deaths within DEATH_WINDOW_S the holder detaches the mount and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from shardfs.cli.daemonize import READY_PREFIX, STANDBY_LINE
from shardfs.daemon.mountpoint import is_mounted, unmount
from shardfs.holder.endings import cgroup_oom_kills, describe
from shardfs.util.proc import leader_exited

log = logging.getLogger("shardfs.holder")

HOLDER_FD_ENV = "SHARDFS_HOLDER_FD"  # shardfs/daemon/handover.py reads these
HOLDER_PID_ENV = "SHARDFS_HOLDER_PID"
# Give up after this many daemon deaths within this many seconds (SHARDFS_HOLDER_GIVE_UP="N/S").
MAX_DEATHS, DEATH_WINDOW_S = 5, 60.0
START_TIMEOUT_S = 120.0  # a takeover that is not serving by then counts as a death
STOP_TIMEOUT_S = 60.0
# The spare starts this long after a daemon is ready, not at once: it would compete for the
# CPU with the daemon's own start, and mounts that end within seconds (tests, scripts) never
# need one. A death before then starts a daemon from scratch (a gap of Python's start-up).
SPARE_DELAY_S = 3.0


@dataclass
class Child:
    """A daemon process of ours and the pipe it reports STANDBY / READY on."""

    proc: subprocess.Popen
    ready_r: int
    standby_w: int = -1  # spares only: "go\n" starts the takeover
    lines: bytes = b""
    standing_by: bool = False
    ready: bool = False
    summary: str = ""
    started: float = field(default_factory=time.monotonic)

    def read_lines(self) -> bool:
        """Read what is on the ready pipe; False at end of file."""
        try:
            chunk = os.read(self.ready_r, 4096)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.lines += chunk
        while b"\n" in self.lines:
            line, self.lines = self.lines.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text + "\n" == STANDBY_LINE:
                self.standing_by = True
            elif text.startswith(READY_PREFIX):
                self.ready, self.summary = True, text[len(READY_PREFIX):]
        return True

    def close(self) -> None:
        for fd in (self.ready_r, self.standby_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ready_r = self.standby_w = -1


class Holder:
    def __init__(self, argv: list[str], mountpoint: str, log_path: str, ready_fd: int) -> None:
        self.argv = argv  # `mount SOURCE... MOUNTPOINT [options]`, as the user gave it
        self.mountpoint = mountpoint
        self.log_path = log_path
        self.ready_fd = ready_fd  # to the waiting `shardfs mount`; -1 once told
        self.fuse_fd = -1
        self.daemon: Child | None = None
        self.spare: Child | None = None
        self.deaths: deque[float] = deque()
        self.takeovers = 0
        self.spare_due = 0.0  # when to start the next spare (monotonic)
        self.restart_asked = False  # SIGUSR1 (shardfs restart), not acted on yet
        self.handing_over = False  # the daemon was told to exit for the spare (a restart)
        self.stop_asked = False
        self.max_deaths, self.window_s = _give_up_rule()
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # -- processes -------------------------------------------------------------------------
    def _start(self, extra: list[str], pass_fds: tuple[int, ...], env: dict[str, str],
               standby: bool) -> Child:
        ready_r, ready_w = os.pipe()
        standby_r = standby_w = -1
        if standby:
            standby_r, standby_w = os.pipe()
            extra = [*extra, "--standby-fd", str(standby_r)]
        cmd = [sys.executable, "-m", "shardfs", *self.argv, "--foreground",
               "--ready-fd", str(ready_w), *extra]
        proc = subprocess.Popen(cmd, pass_fds=(ready_w, *pass_fds,
                                               *((standby_r,) if standby else ())),
                                stdin=subprocess.DEVNULL, env={**os.environ, **env,
                                                               HOLDER_PID_ENV: str(os.getpid())})
        os.close(ready_w)
        if standby_r >= 0:
            os.close(standby_r)
        os.set_blocking(ready_r, False)
        return Child(proc, ready_r, standby_w)

    def _start_spare(self) -> Child:
        os.set_inheritable(self.fuse_fd, True)
        try:
            return self._start(["--fuse-fd", str(self.fuse_fd), "--takeover"], (self.fuse_fd,),
                               {}, standby=True)
        finally:
            os.set_inheritable(self.fuse_fd, False)

    def _drop_spare(self) -> None:
        if self.spare is not None:  # it has touched nothing yet: no cache lock, no mount
            self.spare.proc.kill()
            self.spare.proc.wait()
            self.spare.close()
            self.spare = None

    # -- the first daemon ------------------------------------------------------------------
    def first_daemon(self) -> int | None:
        """Start the daemon that mounts, relay its readiness; None once it serves and handed
        the connection over, else the exit status to leave with."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.daemon = self._start([], (theirs.fileno(),),
                                  {HOLDER_FD_ENV: str(theirs.fileno())}, standby=False)
        theirs.close()
        child = self.daemon
        while not child.ready:
            if self._wait([child.ready_r], 1.0) and not child.read_lines():
                break  # end of file: the daemon failed (its errors went to the terminal)
            if self.stop_asked:  # Ctrl-C reached the waiting `shardfs mount`: it told us
                self.stop_asked = False
                child.proc.send_signal(signal.SIGTERM)
        if not child.ready:
            return child.proc.wait()
        self.fuse_fd = self._receive_fd(ours)
        ours.close()
        self._tell_ready(child)
        if self.fuse_fd < 0:  # the daemon said why (its log); nothing to hold: as before
            return child.proc.wait()
        return None

    def _receive_fd(self, sock: socket.socket) -> int:
        sock.settimeout(10.0)
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except OSError:
            return -1
        if msg != b"fd" or not fds:
            return -1
        os.set_inheritable(fds[0], False)
        return fds[0]

    def _tell_ready(self, child: Child) -> None:
        """Tell the waiting `shardfs mount` (which prints the daemon's pid), then leave the
        terminal: from now on the holder logs to the mount's log file."""
        if self.ready_fd >= 0:
            os.write(self.ready_fd, f"{READY_PREFIX}{child.summary}\tpid={child.proc.pid}\n"
                     .encode())
            os.close(self.ready_fd)
            self.ready_fd = -1
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)

    # -- holding ---------------------------------------------------------------------------
    def hold(self) -> int:
        """Keep the connection until the daemon stops by itself or we give up."""
        assert self.daemon is not None
        log.info("holding the FUSE connection of %s for daemon %d", self.mountpoint,
                 self.daemon.proc.pid)
        self.spare_due = time.monotonic() + SPARE_DELAY_S
        while True:
            oom_before = cgroup_oom_kills()
            status = self._wait_daemon()
            if status is None:  # a stop or restart was asked of us
                if self.stop_asked:
                    return self._stop()
                self._restart()
                continue
            daemon = self.daemon
            daemon.close()
            if self.handing_over:  # shardfs restart: the spare stands by
                self.handing_over = False
                log.info("daemon %d %s for the restart", daemon.proc.pid,
                         describe(status, oom_kills_before=None))
                if not self._go():
                    return self._finish(1, give_up=True)
                continue
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                log.info("daemon %d stopped; the holder ends too", daemon.proc.pid)
                return self._finish(0)
            if not is_mounted(self.mountpoint):
                log.info("daemon %d %s and the mount is gone; the holder ends",
                         daemon.proc.pid, describe(status, oom_kills_before=oom_before))
                return self._finish(0)
            if not self._take_over(daemon, status, oom_before):
                return self._finish(1, give_up=True)

    def _wait_daemon(self) -> int | None:
        """Wait until the daemon ends (its wait status) or a signal asks for something."""
        assert self.daemon is not None
        pidfd = os.pidfd_open(self.daemon.proc.pid)
        try:
            while True:
                if self.stop_asked or self.restart_asked:
                    return None
                timeout = None
                if self.spare is None:
                    timeout = self.spare_due - time.monotonic()
                    if timeout <= 0:
                        self.spare, timeout = self._start_spare(), None
                timeout = ZOMBIE_POLL_S if timeout is None else min(timeout, ZOMBIE_POLL_S)
                readable = self._wait([pidfd, *self._spare_fds()], timeout)
                self._poll_spare(readable)
                if pidfd in readable:
                    _, status = os.waitpid(self.daemon.proc.pid, 0)
                    self.daemon.proc.returncode = status
                    return status
                if leader_exited(self.daemon.proc.pid):
                    # Its main thread is gone but another is stuck in a FUSE request on this
                    # very mount (its own page pusher, say), which only the next daemon can
                    # answer: the process cannot finish dying before a takeover. Take over now
                    # (reaped later).
                    log.warning("daemon %d died with a thread waiting on the mount itself",
                                self.daemon.proc.pid)
                    return signal.SIGKILL
        finally:
            os.close(pidfd)

    def _spare_fds(self) -> list[int]:
        return [self.spare.ready_r] if self.spare is not None and self.spare.ready_r >= 0 \
            else []

    def _poll_spare(self, readable: list[int]) -> None:
        if self.spare is not None and self.spare.ready_r in readable \
                and not self.spare.read_lines():
            log.warning("the spare daemon %d exited (%s); starting another",
                        self.spare.proc.pid, describe(self.spare.proc.wait(),
                                                      oom_kills_before=None))
            self.spare.close()
            self.spare = self._start_spare()

    def _take_over(self, dead: Child, status: int, oom_before: int | None) -> bool:
        """The daemon died with the mount in place: count it, and have a spare take over.
        False: give up."""
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        how = describe(status, oom_kills_before=oom_before)
        if len(self.deaths) >= self.max_deaths:
            log.error("daemon %d %s: %d deaths within %.0f s, giving up: detaching the mount "
                      "%s", dead.proc.pid, how, len(self.deaths), self.window_s,
                      self.mountpoint)
            return False
        log.warning("daemon %d %s; a new daemon takes the mount over", dead.proc.pid, how)
        return self._go()

    def _go(self) -> bool:
        """Have the spare take over; wait until it serves. False: give up."""
        while True:
            spare = self.spare if self.spare is not None else self._start_spare()
            self.spare = None
            os.write(spare.standby_w, b"go\n")
            started = time.monotonic()
            while not spare.ready and time.monotonic() - started < START_TIMEOUT_S:
                if self._wait([spare.ready_r], 1.0) and not spare.read_lines():
                    break
            if spare.ready:
                self.takeovers += 1
                self.daemon = spare
                log.info("daemon %d took the mount over in %.2f s (takeover %d of this holder)",
                         spare.proc.pid, time.monotonic() - started, self.takeovers)
                self.spare_due = time.monotonic() + SPARE_DELAY_S
                return True
            if spare.proc.poll() is None:
                spare.proc.kill()
            status = spare.proc.wait()
            spare.close()
            self.deaths.append(time.monotonic())
            log.error("the new daemon %d could not take the mount over (%s)", spare.proc.pid,
                      describe(status, oom_kills_before=None))
            if len(self.deaths) >= self.max_deaths:
                log.error("%d failed daemons within %.0f s, giving up: detaching the mount %s",
                          len(self.deaths), self.window_s, self.mountpoint)
                return False

    def _restart(self) -> None:
        """`shardfs restart`: a fresh spare (the code installed now), then the old daemon
        leaves the mount to it (SIGUSR1: it exits without unmounting)."""
        assert self.daemon is not None
        self.restart_asked = False
        log.info("restart asked: starting a daemon with the code installed now")
        self._drop_spare()
        self.spare = self._start_spare()
        while not self.spare.standing_by:
            if self.stop_asked:
                return
            if self._wait([self.spare.ready_r], 1.0) and not self.spare.read_lines():
                log.error("the new daemon exited before standing by; restart abandoned")
                self.spare.close()
                self.spare = self._start_spare()
                return
        self.handing_over = True
        self.daemon.proc.send_signal(signal.SIGUSR1)

    def _stop(self) -> int:
        """SIGTERM/SIGINT/SIGHUP to the holder: stop the daemon (it unmounts), then end."""
        assert self.daemon is not None
        log.info("stopping daemon %d", self.daemon.proc.pid)
        self.daemon.proc.send_signal(signal.SIGTERM)
        try:
            self.daemon.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.daemon.proc.kill()
            self.daemon.proc.wait()
        return self._finish(0)

    def _finish(self, code: int, *, give_up: bool = False) -> int:
        self._drop_spare()
        if is_mounted(self.mountpoint):
            result = unmount(self.mountpoint, lazy=True)
            if result.returncode != 0:
                log.error("cannot unmount %s: %s", self.mountpoint, result.stderr.strip())
            elif give_up:
                log.error("detached %s; readers now get ENOTCONN until it is mounted again",
                          self.mountpoint)
        if self.fuse_fd >= 0:
            os.close(self.fuse_fd)
            self.fuse_fd = -1
        return code

    # -- signals ---------------------------------------------------------------------------
    def install_signals(self) -> None:
        signal.set_wakeup_fd(self._sig_w)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_restart)

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stop_asked = True

    def _on_restart(self, signum: int, frame: object) -> None:
        self.restart_asked = True

    def _wait(self, fds: list[int], timeout: float | None) -> list[int]:
        """select() on fds and the signal pipe; the fds that are readable."""
        while True:
            try:
                readable, _, _ = select.select([*fds, self._sig_r], [], [], timeout)
                break
            except InterruptedError:
                continue
        if self._sig_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self._sig_r, 64)
        return [fd for fd in readable if fd != self._sig_r]


ZOMBIE_POLL_S = 0.2  # how often to look for a daemon whose main thread is dead


def _give_up_rule() -> tuple[int, float]:
    text = os.environ.get("SHARDFS_HOLDER_GIVE_UP", "")
    with contextlib.suppress(ValueError):
        deaths, seconds = text.split("/")
        return max(1, int(deaths)), float(seconds)
    return MAX_DEATHS, DEATH_WINDOW_S


def main(argv: list[str]) -> int:
    """python -m shardfs.holder READY_FD MOUNTPOINT LOG_PATH mount SOURCE... MOUNTPOINT ..."""
    ready_fd, mountpoint, log_path, *daemon_argv = argv
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    holder = Holder(daemon_argv, mountpoint, log_path, int(ready_fd))
    holder.install_signals()
    code = holder.first_daemon()
    if code is not None:
        return code if code >= 0 else 128 - code
    return holder.hold()
