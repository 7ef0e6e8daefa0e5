"""The page push's lookup process: stats paths through the mount for the pusher.

Run by `shardfs.fuse.lookups.LookupProcess` as `python -S -E <this file> <the shim's
library>`, its socket as standard input: a program of its own (not a fork of the daemon, which
would keep a copy-on-write copy of the daemon's memory for as long as it lives). Why the
lookups need a process of their own: pagepush.py's docstring.

The protocol, on the stream socket: paths, each ended by a NUL, in; one byte per path out, in
order: b"y" (the stat succeeded: the kernel has the file's inode now) or b"n". A path that
ends in "/" is a directory to list whole (b"y": listed; while pages are pushed, a listing
gives the kernel every listed file's inode: pagepush.py). End of file on
the socket (the daemon closed it, or died) ends the process. The loop is the shim's
(`shardfs_shim_lookup_serve`, loaded with ctypes: no Python per path; a Python loop cost the
pushes ~4 µs of CPU per file and fell behind, docs/benchmarks-notes.md), so this file imports
nothing of shardfs.
"""

import contextlib
import ctypes
import sys

SOCKET = 0


def main() -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write("shardfs lookup")  # what ps and top show
    serve = ctypes.CDLL(sys.argv[1]).shardfs_shim_lookup_serve
    serve.argtypes = [ctypes.c_int]
    serve(SOCKET)  # until end of file (or an error: the daemon sees the socket end either way)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
