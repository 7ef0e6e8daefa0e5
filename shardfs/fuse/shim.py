"""Load shardfs's pyfuse3/libfuse3 shim (`_shim.c`, docs/pyfuse3.md) before pyfuse3 itself.

The shim must be in the global symbol scope before pyfuse3's extension module is loaded, so
that pyfuse3's calls to `fuse_session_new` and `fuse_session_receive_buf` bind to it. Import
pyfuse3 only through `shardfs.fuse` (whose `__init__` loads this module first). Whether the
shim is really in effect is known only after `pyfuse3.init()`: `active()` says so, and the
filesystem keeps its open-based read path when it is not.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_lib: ctypes.PyDLL | None = None
load_error: str | None = None


def _load() -> None:
    global _lib, load_error
    if os.environ.get("SHARDFS_NO_SHIM"):
        load_error = "disabled by SHARDFS_NO_SHIM"
        return
    if "pyfuse3" in sys.modules:
        load_error = "pyfuse3 was imported before the shim"
        return
    spec = importlib.util.find_spec("shardfs.fuse._shim")
    if spec is None or spec.origin is None:
        load_error = "not built (no C compiler or fuse3 headers at install time?)"
        return
    try:
        # PyDLL: calls keep the GIL, which pyfuse3's callbacks (run by process_one) expect.
        _lib = ctypes.PyDLL(spec.origin, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as exc:
        load_error = str(exc)


def active() -> bool:
    """True once a FUSE session was created through the shim (call after `pyfuse3.init`)."""
    return _lib is not None and _lib.shardfs_shim_sessions() > 0


def session_fd() -> int:
    """The /dev/fuse descriptor of the mounted session."""
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    return _lib.shardfs_shim_session_fd()


def process_one() -> int:
    """Receive and answer one FUSE request synchronously (INIT, before forking workers)."""
    if _lib is None:
        raise RuntimeError(f"the pyfuse3 shim is not loaded: {load_error}")
    return _lib.shardfs_shim_process_one()


_load()
