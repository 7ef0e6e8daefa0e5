"""The FUSE session: mount, serve, unmount — the pyfuse3 calls the daemon needs, in one place."""

from __future__ import annotations

import logging

import pyfuse3  # after the shim: shardfs.fuse's __init__ loads it first

from shardfs.fuse import shim
from shardfs.fuse.ops import TIMEOUT, ShardFS

log = logging.getLogger(__name__)


def mount(ops: ShardFS, mountpoint: str, options: set[str]) -> bool:
    """Mount; True when reads need no OPEN (the shim is in effect, see docs/pyfuse3.md)."""
    shim.serve_metadata(ops.tree, uid=ops.uid, gid=ops.gid, timeout=TIMEOUT)
    pyfuse3.init(ops, mountpoint, options)
    if shim.active():
        log.info("serving reads without OPEN requests, metadata %s (pyfuse3 shim in effect)",
                 "in C" if shim.metadata_in_c() else "in Python")
        return True
    log.info("pyfuse3 shim not in effect (%s): files are opened as usual",
             shim.load_error or "not used by pyfuse3")
    return False


def answer_init() -> None:
    """Receive and answer the kernel's INIT now, synchronously (before forking workers, which
    inherit the initialised session). Needs the shim."""
    res = shim.process_one()
    if res <= 0:
        raise RuntimeError(f"no INIT from the kernel (error {-res})")


async def serve(max_tasks: int) -> None:
    """Answer requests until the kernel ends the session (unmount) or the task is cancelled."""
    await pyfuse3.main(max_tasks=max_tasks)


def close(*, unmount: bool) -> None:
    pyfuse3.close(unmount=unmount)
