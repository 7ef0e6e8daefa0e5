"""The parent side of a daemonizing `shardfs mount`: start the daemon, wait for it to be ready,
and if the user gives up first (Ctrl-C, SIGTERM, a closed terminal) stop it and wait until it
has cleaned up, so that nothing is left mounted, running or holding the cache dir."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

READY_PREFIX = "READY "
STANDBY_LINE = "STANDBY\n"  # a holder's spare daemon, waiting to take over
# The holder's "go" to its spare (issue 25, reads during the gap): take over, but before touching
# the connection say TAKING_OVER_LINE on the ready pipe and wait for LET_GO_LINE on the standby
# pipe: the holder may be answering the mount's requests with EIO meanwhile, and stops first.
# A plain "go\n" (the CSI mounter's) takes over at once.
GO_ASKING_LINE = b"go ask\n"
TAKING_OVER_LINE = "TAKING-OVER\n"
LET_GO_LINE = b"ok\n"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CHILD_CLEANUP_S = 30.0  # the daemon unmounts and releases the cache in well under a second


class Interrupted(Exception):
    """A stop signal reached the waiting parent."""


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def _read_all(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 4096):
        parts.append(chunk)
    return b"".join(parts)


def _stop_child(child: subprocess.Popen) -> None:
    """SIGTERM, then wait for the daemon's own clean-up (it unmounts if it got that far, and
    releases and tidies the cache dir); SIGKILL only if it does not finish in time."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(CHILD_CLEANUP_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _fuse_fd(argv: list[str]) -> tuple[int, ...]:
    """The descriptor of --fuse-fd N, which the daemon must inherit."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--fuse-fd=") else \
            argv[i + 1] if arg == "--fuse-fd" and i + 1 < len(argv) else None
        if value is not None and value.isdigit():
            return (int(value),)
    return ()


def run_daemon(argv: list[str], holder: tuple[str, str, str] | None = None) -> int:
    """Start `shardfs mount ARGV -f` as a detached child; return once the mount is ready (0),
    failed (the child's status), or the user interrupted the wait (130). `holder`:
    (mountpoint, log path, deadline): the child is a holder process (shardfs/holder/), which
    starts the daemon and keeps its FUSE connection."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "shardfs", *argv, "--foreground", "--ready-fd", str(write_fd)]
    if holder is not None:
        cmd = [sys.executable, "-m", "shardfs.holder", str(write_fd), *holder, *argv]
    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    child: subprocess.Popen | None = None
    try:
        try:
            child = subprocess.Popen(cmd, pass_fds=(write_fd, *_fuse_fd(argv)),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
            os.close(write_fd)
            write_fd = -1
            message = _read_all(read_fd).decode(errors="replace")
        except Interrupted:
            for s in STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(s, signal.SIG_IGN)
            if child is not None:
                _stop_child(child)
            with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                print("shardfs: interrupted", file=sys.stderr, flush=True)
            return 130
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if message.startswith(READY_PREFIX):
        summary, _, pid = message[len(READY_PREFIX):].strip().partition("\tpid=")
        if pid:  # a holder started the daemon and keeps its connection
            print(f"shardfs: {summary} (daemon pid {pid}, holder pid {child.pid})")
        else:
            print(f"shardfs: {summary} (daemon pid {child.pid})")
        return 0
    return child.wait() or 1
