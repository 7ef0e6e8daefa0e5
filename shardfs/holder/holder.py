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

While no daemon serves (from a death until the next daemon says READY) readers' requests wait
in the kernel; once that gap has lasted the mount's --deadline, the holder answers them with
EIO (gap.py) until the next daemon is about to touch the connection: the spare asks first
(TAKING-OVER on its ready pipe) and the holder stops reading before it answers "ok".

The daemon stopping by itself (status 0: SIGTERM, `shardfs umount`, `fusermount3 -u`) ends
the holder, which unmounts if the mount is still there. SIGTERM/SIGINT/SIGHUP to the holder
stop the daemon the same way. A daemon that keeps dying is not restarted forever: after
MAX_DEATHS deaths within DEATH_WINDOW_S, or MAX_DEATHS in a row with no daemon serving in
between (a takeover that never comes up: each try is a death after the start timeout), the
holder detaches the mount and exits.
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
from enum import Enum

from shardfs.cli.daemonize import (
    GO_ASKING_LINE,
    LET_GO_LINE,
    READY_PREFIX,
    STANDBY_LINE,
    TAKING_OVER_LINE,
)
from shardfs.daemon.mountpoint import is_mounted, unmount
from shardfs.holder.endings import cgroup_oom_kills, describe
from shardfs.holder.gap import ConnectionEnded, Gap
from shardfs.util.proc import leader_exited

log = logging.getLogger("shardfs.holder")

HOLDER_FD_ENV = "SHARDFS_HOLDER_FD"  # shardfs/daemon/handover.py reads these
HOLDER_PID_ENV = "SHARDFS_HOLDER_PID"
# Give up after this many daemon deaths within this many seconds (SHARDFS_HOLDER_GIVE_UP="N/S").
MAX_DEATHS, DEATH_WINDOW_S = 5, 60.0
# A takeover not serving within max(this, --deadline) counts as a death (then MAX_DEATHS in a
# row give up). Takeovers measure 0.03-0.3 s with a spare, 1-4 s starting Python on loaded
# cores, plus up to 10 s waiting for the old daemon's cache lock: 30 s is 3x the worst of it.
START_TIMEOUT_FLOOR_S = 30.0
DEFAULT_DEADLINE_S = 60.0  # the mount's --deadline default (shardfs/cli/config.py)
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
    taking_over: bool = False  # asked to touch the connection (after "go ask")
    let_go: bool = False  # ... and was told "ok": from then on only it reads the connection
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
            elif text + "\n" == TAKING_OVER_LINE:
                self.taking_over = True
            elif text.startswith(READY_PREFIX):
                self.ready, self.summary = True, text[len(READY_PREFIX):]
        return True

    def close(self) -> None:
        for fd in (self.ready_r, self.standby_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ready_r = self.standby_w = -1


class Outcome(Enum):
    """How a wait for a new daemon ended."""

    SERVING = "serving"
    GIVE_UP = "give up"
    STOP = "stop"  # SIGTERM/SIGINT/SIGHUP to the holder meanwhile
    GONE = "gone"  # the mount was unmounted meanwhile
    EXITED = "exited"  # the new daemon ended before serving (tried again)
    TIMED_OUT = "timed out"  # ... or did not serve within the start timeout (tried again)


class Holder:
    def __init__(self, argv: list[str], mountpoint: str, log_path: str, ready_fd: int,
                 deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        self.argv = argv  # `mount SOURCE... MOUNTPOINT [options]`, as the user gave it
        self.mountpoint = mountpoint
        self.log_path = log_path
        self.ready_fd = ready_fd  # to the waiting `shardfs mount`; -1 once told
        self.fuse_fd = -1
        self.daemon: Child | None = None
        self.spare: Child | None = None
        self.deaths: deque[float] = deque()
        self.deaths_in_a_row = 0  # since a daemon last said READY
        self.deadline_s = deadline_s  # the mount's --deadline: how long a read may wait
        self.start_timeout_s = max(START_TIMEOUT_FLOOR_S, deadline_s)
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
            gap_started = time.monotonic()  # no daemon serves from here on
            daemon = self.daemon
            daemon.close()
            if self.handing_over:  # shardfs restart: the spare stands by
                self.handing_over = False
                log.info("daemon %d %s for the restart", daemon.proc.pid,
                         describe(status, oom_kills_before=None))
                outcome = self._go(gap_started)
                if outcome is not Outcome.SERVING:
                    return self._end(outcome)
                continue
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                log.info("daemon %d stopped; the holder ends too", daemon.proc.pid)
                return self._finish(0)
            if not is_mounted(self.mountpoint):
                log.info("daemon %d %s and the mount is gone; the holder ends",
                         daemon.proc.pid, describe(status, oom_kills_before=oom_before))
                return self._finish(0)
            outcome = self._take_over(daemon, status, oom_before, gap_started)
            if outcome is not Outcome.SERVING:
                return self._end(outcome)

    def _end(self, outcome: Outcome) -> int:
        if outcome is Outcome.STOP:
            log.info("stop asked while no daemon serves: the holder ends")
            return self._finish(0)
        if outcome is Outcome.GONE:
            log.info("the mount %s is gone; the holder ends", self.mountpoint)
            return self._finish(0)
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
                    # Its main thread is gone but another is stuck on this very mount (as the
                    # page pusher's lookups were before they became the lookup process's),
                    # which only the next daemon can answer: the process cannot
                    # finish dying before a takeover. Take over now (the new daemon takes the
                    # cache dir's lock over; the process is reaped later).
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

    def _take_over(self, dead: Child, status: int, oom_before: int | None,
                   gap_started: float) -> Outcome:
        """The daemon died with the mount in place: count it, and have a spare take over."""
        how = describe(status, oom_kills_before=oom_before)
        too_many = self._count_death()
        if too_many:
            log.error("daemon %d %s: %s, giving up: detaching the mount %s", dead.proc.pid,
                      how, too_many, self.mountpoint)
            return Outcome.GIVE_UP
        log.warning("daemon %d %s; a new daemon takes the mount over", dead.proc.pid, how)
        return self._go(gap_started)

    def _count_death(self) -> str | None:
        """Count a death (a daemon that died, or one that could not take over); why to give
        up, or None."""
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        self.deaths_in_a_row += 1
        if len(self.deaths) >= self.max_deaths:
            return f"{len(self.deaths)} deaths within {self.window_s:.0f} s"
        if self.deaths_in_a_row >= self.max_deaths:
            return (f"{self.deaths_in_a_row} deaths in a row with no daemon serving in between "
                    f"(start timeout {self.start_timeout_s:.0f} s)")
        return None

    def _go(self, gap_started: float) -> Outcome:
        """Have the spare take over and wait until it serves; meanwhile, once the gap has
        lasted the deadline, answer the mount's requests with EIO (until a new daemon is about
        to touch the connection)."""
        gap = Gap(self.fuse_fd, gap_started, self.deadline_s, self.mountpoint)
        try:
            while True:
                spare = self.spare if self.spare is not None else self._start_spare()
                self.spare = None
                started = time.monotonic()
                outcome = self._wait_serving(spare, gap) if self._tell(spare, GO_ASKING_LINE) \
                    else Outcome.EXITED
                if outcome is Outcome.SERVING:
                    self._serving(spare, started, gap)
                if outcome not in (Outcome.EXITED, Outcome.TIMED_OUT):
                    return outcome
                status = self._discard(spare)
                log.error("the new daemon %d could not take the mount over (%s)", spare.proc.pid,
                          f"not serving within the start timeout of {self.start_timeout_s:.0f} "
                          "s: killed" if outcome is Outcome.TIMED_OUT
                          else describe(status, oom_kills_before=None))
                if not is_mounted(self.mountpoint):
                    return Outcome.GONE
                too_many = self._count_death()
                if too_many:
                    log.error("%s, giving up: detaching the mount %s", too_many,
                              self.mountpoint)
                    return Outcome.GIVE_UP
        finally:
            gap.stop("no new daemon")

    def _wait_serving(self, spare: Child, gap: Gap) -> Outcome:
        """Until the spare says READY (SERVING), exits (EXITED) or is not serving within the
        start timeout (TIMED_OUT), the holder is asked to stop (STOP) or the mount ends
        (GONE). Once the gap has lasted the deadline and until the spare asks to touch the
        connection, the holder answers the mount's requests with EIO."""
        started = time.monotonic()
        while not spare.ready:
            now = time.monotonic()
            if now - started >= self.start_timeout_s:
                return Outcome.TIMED_OUT
            if self.stop_asked:
                self._discard(spare)
                return Outcome.STOP
            try:
                if not spare.taking_over:  # it has not touched the connection: ours to answer
                    gap.refuse_if_due(now)
                timeout = min(1.0, self.start_timeout_s - (now - started), gap.due_in(now))
                readable = self._wait([spare.ready_r, *gap.fds()], max(0.0, timeout))
                gap.answer(readable)
            except ConnectionEnded:
                self._discard(spare)
                return Outcome.GONE
            if spare.ready_r in readable and not spare.read_lines():
                return Outcome.EXITED  # end of file
            if spare.taking_over and not spare.let_go:
                gap.stop(f"daemon {spare.proc.pid} takes the connection")
                spare.let_go = True  # every request the holder read is answered
                if not self._tell(spare, LET_GO_LINE):
                    return Outcome.EXITED
        return Outcome.SERVING

    def _discard(self, spare: Child) -> int:
        """Kill a new daemon that will not serve (if it still runs); its wait status."""
        if spare.proc.poll() is None:
            spare.proc.kill()
        status = spare.proc.wait()
        spare.close()
        return status

    def _tell(self, spare: Child, line: bytes) -> bool:
        """Write to the spare's standby pipe; False if it is gone."""
        try:
            os.write(spare.standby_w, line)
        except OSError:
            return False
        return True

    def _serving(self, spare: Child, started: float, gap: Gap) -> None:
        self.takeovers += 1
        self.deaths_in_a_row = 0
        self.daemon = spare
        failed = f"; {gap.failed} requests failed with EIO" if gap.failed else ""
        log.info("daemon %d took the mount over in %.2f s (takeover %d of this holder; "
                 "%.2f s without a daemon%s)", spare.proc.pid, time.monotonic() - started,
                 self.takeovers, time.monotonic() - gap.started, failed)
        self.spare_due = time.monotonic() + SPARE_DELAY_S

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
    """python -m shardfs.holder READY_FD MOUNTPOINT LOG_PATH DEADLINE mount SOURCE... ...
    (DEADLINE: the mount's --deadline in seconds, as shardfs/cli/config.py parsed it)"""
    ready_fd, mountpoint, log_path, deadline, *daemon_argv = argv
    from shardfs.cli.logsetup import setup_logging

    setup_logging("info")  # stderr, as the daemon's; signed URLs' signatures redacted
    holder = Holder(daemon_argv, mountpoint, log_path, int(ready_fd), float(deadline))
    holder.install_signals()
    code = holder.first_daemon()
    if code is not None:
        return code if code >= 0 else 128 - code
    return holder.hold()
