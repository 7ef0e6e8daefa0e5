"""The page push's lookup process: stats paths through the mount for the pusher.

Run by `shardfs.fuse.pagepush.LookupProcess` as `python -S -E <this file>`, its socket as
standard input: a program of its own (not a fork of the daemon, which would keep a
copy-on-write copy of the daemon's memory for as long as it lives). Why
the lookups need a process of their own: pagepush.py's docstring.

The protocol, on the stream socket: paths, each ended by a NUL, in; one byte per path out, in
order: b"y" (the stat succeeded: the kernel has the file's inode now) or b"n". End of file on
the socket (the daemon closed it, or died) ends the process. It imports only `os` and
`contextlib`.
"""

import contextlib
import os

SOCKET = 0


def _answer(path: bytes) -> int:
    try:
        os.stat(path)
    except OSError:
        return 0x6E  # b"n"
    return 0x79  # b"y"


def serve() -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write("shardfs lookup")  # what ps and top show
    pending = b""
    while True:
        try:
            data = os.read(SOCKET, 1 << 16)
        except InterruptedError:
            continue
        if not data:
            return
        *paths, pending = (pending + data).split(b"\0")
        if not paths:
            continue
        answers = memoryview(bytes(_answer(p) for p in paths))
        while answers:
            answers = answers[os.write(SOCKET, answers):]


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        serve()
