"""The FUSE session: mount, serve, unmount — the pyfuse3 calls the daemon needs, in one place."""

from __future__ import annotations

import ctypes
import logging
import os

import pyfuse3  # after the shim: shardfs.fuse's __init__ loads it first

from shardfs.fuse import shim
from shardfs.fuse.ops import TIMEOUT, ShardFS

log = logging.getLogger(__name__)


def mount(ops: ShardFS, mountpoint: str, options: set[str], *, fuse_fd: int | None = None
          ) -> bool:
    """Mount; True when reads need no OPEN (the shim is in effect, see docs/pyfuse3.md).

    `fuse_fd`: serve this already-open /dev/fuse descriptor, which another process mounted
    (libfuse >= 3.3 takes a mountpoint "/dev/fd/N" as "use N, do not mount"); libfuse then
    never unmounts it either: the process that mounted it does."""
    in_c = shim.serve_metadata(ops.tree, uid=ops.uid, gid=ops.gid, timeout=TIMEOUT)
    if in_c and shim.reader_thread_wanted() and not shim.use_reader():
        log.warning("the shim's reader thread cannot be set up: requests go to pyfuse3's loop")
    pyfuse3.init(ops, mountpoint if fuse_fd is None else f"/dev/fd/{fuse_fd}", options)
    if shim.active():
        log.info("serving reads without OPEN requests, metadata %s (pyfuse3 shim in effect)",
                 "in C" if shim.metadata_in_c() else "in Python")
        return True
    log.info("pyfuse3 shim not in effect (%s): files are opened as usual",
             shim.load_error or "not used by pyfuse3")
    return False


def libfuse_version() -> str:
    """The loaded libfuse3's version ("3.14.0"), or "" when it cannot be asked."""
    try:
        lib = ctypes.CDLL("libfuse3.so.3", mode=os.RTLD_NOLOAD)
        lib.fuse_pkgversion.restype = ctypes.c_char_p
        return lib.fuse_pkgversion().decode()
    except (OSError, AttributeError):
        return ""


def answer_init() -> None:
    """Receive and answer the kernel's INIT now, synchronously (before forking workers, which
    inherit the initialised session). Needs the shim."""
    res = shim.process_one()
    if res <= 0:
        raise RuntimeError(f"no INIT from the kernel (error {-res})")


def resume(ops: ShardFS, fuse_fd: int, init_request: bytes, options: set[str]) -> bytes:
    """Adopt `fuse_fd`, a live connection whose INIT an earlier daemon answered: the session
    is created on a pipe, libfuse processes the recorded INIT request (its reply goes into the
    pipe, never to the kernel, which has its answer already), and only then does `fuse_fd`
    take the pipe's place as the session's descriptor. Needs the shim; returns the INIT
    reply libfuse made (fuse_out_header + fuse_init_out), which the caller may compare with
    the first one."""
    if not shim.loaded():
        raise RuntimeError(f"taking a mount over needs the pyfuse3 shim ({shim.load_error})")
    reply_r, reply_w = os.pipe()
    try:
        mount(ops, "", options, fuse_fd=reply_w)
        if not shim.active():
            raise RuntimeError("taking a mount over needs the pyfuse3 shim, not in effect")
        shim.replay_init(init_request)
        os.set_blocking(reply_r, False)
        try:
            reply = os.read(reply_r, 4096)
        except BlockingIOError:
            reply = b""
        os.dup2(fuse_fd, reply_w, inheritable=False)  # the session's fd is now the connection
    finally:
        os.close(reply_r)
    os.close(fuse_fd)
    return reply


async def serve(max_tasks: int) -> None:
    """Answer requests until the kernel ends the session (unmount) or the task is cancelled.
    With the shim's reader thread (docs/pyfuse3.md), requests are read by that thread, started
    here in the process that serves (after any fork) and stopped when the loop ends."""
    threaded = shim.reader_wait_fd() >= 0 and shim.active()
    if threaded:
        res = shim.start_reader()
        if res != 0:
            log.warning("the shim's reader thread did not start (%s): requests go to "
                        "pyfuse3's loop", os.strerror(-res))
            threaded = False
    try:
        await pyfuse3.main(max_tasks=max_tasks)
    finally:
        if threaded:
            shim.stop_reader()


def close(*, unmount: bool) -> None:
    pyfuse3.close(unmount=unmount)
