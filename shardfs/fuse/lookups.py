"""The page push's lookup process, seen from the daemon: started on first use, stopped with the
pusher (the program it runs: lookupproc.py; why the lookups need a process of their own:
pagepush.py's docstring)."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import threading
from pathlib import Path

from shardfs.fuse import shim

# What a send or receive on its socket fails with once the process has ended.
GONE = (errno.EPIPE, errno.ECONNRESET)


class LookupProcess:
    """The process that makes the pusher's lookups (lookupproc.py; see the module's
    docstring): started on first use, ended (its socket closed, then reaped) by `close`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # connect (pusher's thread) against close (the loop's)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._closed = False

    def connect(self) -> socket.socket:
        """A socket to the process for one shard's push, starting the process the first time
        (in the pusher's thread: its start-up takes ~20 ms). A duplicate of ours, closed
        by the caller: a push thread abandoned at shutdown goes on with its own descriptor,
        never a number reused meanwhile. OSError (EPIPE) once closed."""
        with self._lock:
            if self._closed:
                raise OSError(errno.EPIPE, "the lookup process was stopped")
            if self._sock is None:
                ours, theirs = socket.socketpair()
                try:
                    # Only its socket and /dev/null (close_fds: never /dev/fuse, which must
                    # close with the daemon's; no pipe someone waits to see closed), its
                    # working directory at / (it keeps no mount busy).
                    if shim.library_path is None:
                        raise OSError(errno.ENOENT, "the shim is not loaded")
                    self._proc = subprocess.Popen(
                        [sys.executable, "-S", "-E",
                         str(Path(__file__).with_name("lookupproc.py")), shim.library_path],
                        stdin=theirs, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        cwd="/")
                finally:
                    theirs.close()
                self._sock = ours
            return self._sock.dup()

    def close(self) -> None:
        """End the process: at end of file on every descriptor of our end it exits (at once,
        or when a stat it waits in fails or is answered); reaped by a thread, so that no
        zombie is left."""
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            proc, self._proc = self._proc, None
        if sock is not None:
            sock.close()
        if proc is not None:
            threading.Thread(target=proc.wait, name="shardfs lookup reaper", daemon=True).start()


def look_up(sock: socket.socket, path: bytes) -> bool:
    """One path's stat by the lookup process (the Python loop's way; the C loop sends
    batches)."""
    sock.sendall(path + b"\0")
    answer = sock.recv(1)
    if not answer:
        raise OSError(errno.EPIPE, "the lookup process ended")
    return answer == b"y"
