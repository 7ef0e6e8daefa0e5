"""Giving the FUSE connection to whoever keeps it alive across the daemon's death: the holder
process that started this daemon (`shardfs/holder/`), or systemd's file descriptor store.

Either way the keeper gets a duplicate of the session's descriptor (the same open file, so
requests this daemon has read and not answered stay queued on it when the daemon dies), and a
new daemon started with it (`--fuse-fd N --takeover`) takes the mount over. Nothing is handed
when a takeover could not work: the session record was not written (no shim) or the kernel
has no FUSE_NOTIFY_RESEND; the daemon says so once and the mount behaves as before.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import socket

from shardfs.fuse.worker import resend_unanswered

log = logging.getLogger(__name__)

HOLDER_FD_ENV = "SHARDFS_HOLDER_FD"  # a unix socket to the holder, inherited
HOLDER_PID_ENV = "SHARDFS_HOLDER_PID"
NO_RESEND_ENV = "SHARDFS_NO_RESEND"  # tests: behave as on a kernel without it
FDNAME = "shardfs-fuse"  # systemd's FDNAME= / LISTEN_FDNAMES for the connection


def resend_supported(fuse_fd: int) -> bool:
    """Whether the kernel has FUSE_NOTIFY_RESEND (Linux >= 6.9): asked by sending one (it
    requeues nothing that matters: at worst a request in flight is answered twice)."""
    if os.environ.get(NO_RESEND_ENV):
        return False
    try:
        resend_unanswered(fuse_fd)
    except OSError as exc:
        return exc.errno != errno.EINVAL
    return True


def keeper() -> str | None:
    """Who keeps the connection: "holder", "systemd" (a notify socket with an fd store) or
    None."""
    if os.environ.get(HOLDER_FD_ENV) or os.environ.get(HOLDER_PID_ENV):
        return "holder"
    # systemd >= 254 sets $FDSTORE when the unit has FileDescriptorStoreMax=; our unit also
    # sets SHARDFS_FDSTORE=1 for older ones (Debian 12 has 252).
    fdstore = os.environ.get("FDSTORE", "")
    if os.environ.get("NOTIFY_SOCKET") and ((fdstore.isdigit() and int(fdstore) > 0)
                                            or os.environ.get("SHARDFS_FDSTORE") == "1"):
        return "systemd"
    return None


def holder_pid() -> int | None:
    value = os.environ.get(HOLDER_PID_ENV)
    return int(value) if value and value.isdigit() else None


def hand_over(fuse_fd: int, *, recorded: bool) -> str | None:
    """Give a duplicate of `fuse_fd` to the keeper; who got it, or None (said once why)."""
    who = keeper()
    reason = None
    if not recorded:
        reason = "the pyfuse3 shim is not in effect"
    elif not resend_supported(fuse_fd):
        reason = "this kernel has no FUSE_NOTIFY_RESEND (Linux < 6.9)"
    if who == "holder":
        sock = socket.socket(fileno=int(os.environ[HOLDER_FD_ENV]))
        try:
            if reason is None:
                sock.sendmsg([b"fd"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fuse_fd]))])
            else:
                sock.sendall(b"none " + reason.encode())
        except OSError as exc:
            reason = reason or f"the holder is gone ({exc})"
        finally:
            sock.close()
            del os.environ[HOLDER_FD_ENV]
    elif who == "systemd" and reason is None and not _store_in_systemd(fuse_fd):
        reason = "systemd refused the descriptor (FileDescriptorStoreMax= not set?)"
    if reason is not None:
        log.warning("this mount cannot outlive its daemon: %s; if the daemon dies, the mount "
                    "is lost (as before)", reason)
        return None
    if who is not None:
        log.info("the FUSE connection is kept by %s: a new daemon can take the mount over",
                 "the holder process" if who == "holder" else "systemd's fd store")
    return who


def _store_in_systemd(fuse_fd: int) -> bool:
    """sd_notify FDSTORE=1 with the descriptor attached (systemd's documented protocol)."""
    address = os.environ["NOTIFY_SOCKET"]
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.connect(address)
            sock.sendmsg([f"FDSTORE=1\nFDNAME={FDNAME}".encode()],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fuse_fd]))])
        except OSError as exc:
            log.warning("cannot store the FUSE descriptor in systemd: %s", exc)
            return False
    return True


def descriptor_from_systemd() -> int | None:
    """The connection systemd hands back on a restart (LISTEN_FDS / LISTEN_PID /
    LISTEN_FDNAMES, descriptors from 3 on), or None. The variables are removed, as
    sd_listen_fds(unset_environment=1) does, so children do not take them for theirs."""
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    if not pid or not count or not pid.isdigit() or int(pid) != os.getpid():
        return None
    for i in range(int(count)):
        if i < len(names) and names[i] == FDNAME:
            os.set_inheritable(3 + i, False)
            return 3 + i
    return None
