"""What `shardfs top` shows of one mount: rates between two stats snapshots, and a history.

A snapshot is the daemon's `user.shardfs.stats` (shardfs/daemon/lifecycle.py); rates are
differences over the time between two of them. Files read through the page cache never reach
the daemon: those come from an OpenCounter (inotify) that runs beside it.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import deque
from typing import Any

from shardfs.cli.opens import OpenCounter
from shardfs.daemon.control import STATS_XATTR
from shardfs.daemon.mountpoint import FSTYPE, mounted_fstype
from shardfs.util.sizes import format_duration, format_utc
from shardfs.util.urls import EXPIRES_SOON_S

HISTORY = 60  # refreshes kept for the sparklines
MiB = float(1 << 20)


class Gone(Exception):
    """The mount is not there any more (unmounted, or its daemon died)."""


class SnapshotRead:
    """One read of a mount's snapshot, in a daemon thread of its own: a daemon that hangs
    must not hang the view, nor its exit (a hung FUSE request cannot be interrupted)."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.done = threading.Event()
        self.result: dict[str, Any] | None = None
        self.error: Exception | None = None
        threading.Thread(target=self._run, name="stats", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = read_snapshot(self.mountpoint)
        except (Gone, ValueError, PermissionError) as exc:
            self.error = exc
        finally:
            self.done.set()


def read_snapshot(mountpoint: str) -> dict[str, Any]:
    """The daemon's snapshot; Gone when it is not a running shardfs mount now."""
    if mounted_fstype(mountpoint) != FSTYPE:
        raise Gone("not mounted")
    try:
        raw = os.getxattr(mountpoint, STATS_XATTR)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise Gone("the daemon is gone (transport endpoint not connected)") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError("no access: another user's mount, without allow_other") \
                from None
        raise Gone(exc.strerror or str(exc)) from None
    return json.loads(raw)


def _get(d: dict[str, Any] | None, *path: str) -> float:
    value: Any = d
    for part in path:
        if not isinstance(value, dict):
            return 0.0
        value = value.get(part)
    return float(value) if isinstance(value, int | float) else 0.0


class MountWatch:
    """One mount's snapshots over time and the rates `top` shows."""

    def __init__(self, mountpoint: str, *, count_opens: bool = True) -> None:
        self.mountpoint = mountpoint
        self.count_opens = count_opens
        self.state = "starting"  # starting | ok | gone | stalled | denied
        self.reason = ""
        self.last: dict[str, Any] | None = None
        self._prev: tuple[float, dict[str, Any], int, int] | None = None
        self._pending: SnapshotRead | None = None
        self.rates: dict[str, Any] = {}
        self.history: dict[str, deque[float]] = {k: deque(maxlen=HISTORY)
                                                 for k in ("files", "read", "fetched")}
        self.opens: OpenCounter | None = None  # started once the mount has answered

    def close(self) -> None:
        if self.opens is not None:
            self.opens.close()
            self.opens = None

    def begin(self) -> None:
        """Ask for a snapshot (unless the last request is still unanswered)."""
        if self.state != "gone" and self._pending is None:
            self._pending = SnapshotRead(self.mountpoint)

    def finish(self, deadline: float) -> None:
        """Take the answer, waiting until `deadline` (time.monotonic()) at most."""
        pending = self._pending
        if pending is None:
            return
        if not pending.done.wait(max(0.0, deadline - time.monotonic())):
            self.state, self.reason = "stalled", "no answer to the stats request"
            return
        self._pending = None
        if isinstance(pending.error, Gone):
            self.state, self.reason = "gone", str(pending.error)
            self.close()
            return
        if isinstance(pending.error, PermissionError):
            self.state, self.reason = "denied", str(pending.error)
            return
        if pending.result is None:  # not JSON: a broken answer
            self.state, self.reason = "stalled", f"unreadable stats: {pending.error}"
            return
        self._take(pending.result)

    def _take(self, snap: dict[str, Any]) -> None:
        if self.opens is None and self.count_opens:
            self.opens = OpenCounter(self.mountpoint)
            self.opens.start()
        now = time.monotonic()
        files = self.opens.files if self.opens is not None else 0
        nbytes = self.opens.bytes if self.opens is not None else 0
        if self._prev is not None and self._prev[1].get("pid") == snap.get("pid"):
            self.rates = self._rates(now - self._prev[0], self._prev[1], snap,
                                     files - self._prev[2], nbytes - self._prev[3])
            self.history["files"].append(self.rates["files_per_s"] or 0.0)
            self.history["read"].append(self.rates["read_bps"])
            self.history["fetched"].append(self.rates["fetch_bps"])
        self._prev = (now, snap, files, nbytes)
        self.last = snap
        self.state, self.reason = "ok", ""

    def _rates(self, dt: float, a: dict[str, Any], b: dict[str, Any], files: int,
               opened_bytes: int) -> dict[str, Any]:
        def rate(*path: str) -> float:
            return max(0.0, (_get(b, *path) - _get(a, *path)) / dt) if dt > 0 else 0.0

        counting = self.opens is not None and self.opens.watching
        daemon_bps = rate("bytes_served")
        reads = rate("reader", "reads")
        hits = rate("reader", "cache_hits") + rate("reader", "frontier_hits")
        # Bytes of the files closed, less what the daemon served: what the page cache gave.
        read_bps = max(daemon_bps, opened_bytes / dt) if counting and dt > 0 else daemon_bps
        return {
            "interval_s": round(dt, 3),
            "files_per_s": round(files / dt, 1) if counting and dt > 0 else None,
            "read_bps": round(read_bps),
            "page_cache_bps": round(read_bps - daemon_bps) if counting else None,
            "daemon_bps": round(daemon_bps),
            "daemon_reads_per_s": round(reads, 1),
            "reads_in_c_per_s": round(rate("disk_reads", "in_c"), 1),
            "fetch_bps": round(rate("bytes_fetched")),
            "link_peak_bps": b.get("link_peak_bps"),
            "shard_fetches": b.get("shards_fetching", 0),
            "member_fetches": b.get("member_fetches_in_flight", 0),
            "reads_waiting": b.get("reads_in_flight", 0),
            "oldest_wait_s": b.get("oldest_read_s", 0.0),
            "cache_used_bytes": b.get("cache_used_bytes", 0),
            "cache_budget_bytes": b.get("cache_budget_bytes", 0),
            "evictions_per_s": round(rate("evictions"), 2),
            "hit_ratio_now": round(hits / reads, 4) if reads else None,
            "hit_ratio": b.get("hit_ratio"),
            "cpu_daemon": round(rate("cpu_s", "daemon"), 3),
            "cpu_workers": round(rate("cpu_s", "workers"), 3),
            "workers": b.get("worker_count", 0),
            "lookahead_bytes": _get(b, "lookahead", "buffered_bytes")
            if b.get("lookahead") else None,
            "lookahead_budget": _get(b, "lookahead", "buffer_bytes")
            if b.get("lookahead") else None,
            "retries_per_s": round(rate("source", "retries"), 2),
            "errors": int(_get(b, "source", "errors")),
            "fetch_errors": int(_get(b, "reader", "fetch_errors")),
            "eio": int(_get(b, "reader", "eio")),
        }

    def record(self) -> dict[str, Any]:
        """One JSON object for `--json`."""
        out: dict[str, Any] = {"mountpoint": self.mountpoint, "state": self.state}
        if self.reason:
            out["reason"] = self.reason
        if self.last is not None and self.state == "ok":
            out["pid"] = self.last.get("pid")
            for key in ("shards", "shards_cached", "shards_in_place"):
                out[key] = self.last.get(key, 0)
            out["signed_until"] = self.last.get("signed_until")
            out.update(self.rates)
        note = self.page_cache_note()
        if note:
            out["page_cache_note"] = note
        return out

    def signature_note(self) -> str | None:
        """When the mount's signed URLs expire, if they say (EXPIRED once past)."""
        until = self.last.get("signed_until") if self.last is not None else None
        if not isinstance(until, int | float):
            return None
        left = until - time.time()
        if left <= 0:
            return f"EXPIRED at {format_utc(until)}: fetches are refused (a new token is needed)"
        soon = "  SOON" if left < EXPIRES_SOON_S else ""
        return f"URLs valid until {format_utc(until)} (in {format_duration(left)}){soon}"

    def page_cache_note(self) -> str | None:
        """Why the page-cache figures are missing or low, if they are."""
        if self.opens is None:
            return None
        if self.opens.error:
            return self.opens.error
        if self.opens.overflows:
            return (f"the inotify queue overflowed {self.opens.overflows} times: files/s and "
                    "page-cache MiB/s are low (raise fs.inotify.max_queued_events)")
        return None
