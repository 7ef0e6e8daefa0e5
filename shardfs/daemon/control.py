"""The daemon's control socket and the commands that use it.

The socket lives in Linux's abstract namespace (`@shardfs/<hash of the cache dir>`), so no
path length limit or stale file gets in the way; only the daemon's own user and root may use
it (checked with SO_PEERCRED). One JSON request line in, one JSON response line out.
`shardfs stats` needs no socket (it reads the `user.shardfs.stats` xattr on the mount root);
`shardfs warm` sends the paths to warm and then polls for progress. Nothing of this appears
inside the mounted tree.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from shardfs.daemon.mountpoint import shardfs_root
from shardfs.util.progress import ProgressLine

log = logging.getLogger(__name__)
STATS_XATTR = "user.shardfs.stats"
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
_MAX_REQUEST = 16 << 20


class ControlError(Exception):
    """The daemon could not be reached or refused the request."""


# -- daemon side ---------------------------------------------------------------------------
def control_address(cache_dir: str) -> str:
    """The printable name of a daemon's socket ('@' stands for the abstract namespace)."""
    return "@shardfs/" + hashlib.sha256(cache_dir.encode()).hexdigest()[:24]


def _sockaddr(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def peer_allowed(sock: socket.socket) -> bool:
    """The peer is root or this daemon's user."""
    return uid_allowed(peer_credentials(sock)[1])


def uid_allowed(uid: int) -> bool:
    """A peer of this uid may use the daemon's sockets: root or this daemon's user."""
    return uid in (0, os.getuid())


async def bind_when_free(sock: trio.socket.SocketType, address: str, patient_s: float) -> bool:
    """Bind `sock` to a socket address of ours; if another process has it, try again for up to
    `patient_s` seconds. A takeover waits so: a killed daemon that lingers (a thread of it
    waits on the mount, docs/design.md "A daemon that cannot finish dying") holds its sockets
    until this daemon answers that request, so the new daemon serves first and binds when the
    old one lets go. False if it never did (logged)."""
    waited = 0.0
    while True:
        try:
            await sock.bind(_sockaddr(address))
            if waited:
                log.info("socket %s bound after %.1f s", address, waited)
            return True
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or waited >= patient_s:
                if not patient_s:
                    raise
                log.error("cannot bind %s (%s): serving without it", address, exc.strerror)
                return False
            if not waited:
                log.warning("socket %s is still held by the previous daemon: binding it once "
                            "that one is gone", address)
        await trio.sleep(0.05)
        waited += 0.05


async def serve_control(address: str, handler: Handler, *, patient_s: float = 0.0,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on the control socket until cancelled."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if not await bind_when_free(sock, address, patient_s):
        sock.close()
        return
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()

            async def one(stream: trio.SocketStream) -> None:
                async with stream:
                    await _answer(stream, handler, peer_allowed(stream.socket))

            while True:
                stream = await listener.accept()
                nursery.start_soon(one, stream)
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def _answer(stream: trio.SocketStream, handler: Handler, allowed: bool) -> None:
    data = b""
    with trio.move_on_after(10):
        while not data.endswith(b"\n") and len(data) < _MAX_REQUEST:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
    try:
        if not allowed:  # warming moves a lot of data: the daemon's owner (or root) only
            raise PermissionError("permission denied")
        request = json.loads(data)
        if not isinstance(request, dict):
            raise ValueError("expected a JSON object")
        response = await handler(request)
    except Exception as exc:  # a bad request must not take the daemon down
        log.warning("control request failed: %s", exc)
        response = {"error": str(exc)}
    await stream.send_all(json.dumps(response).encode() + b"\n")


# -- client side ---------------------------------------------------------------------------
def read_stats(mountpoint: str) -> dict[str, Any]:
    try:
        return json.loads(os.getxattr(mountpoint, STATS_XATTR))
    except OSError as exc:
        raise ControlError(f"{mountpoint} is not a running shardfs mount ({exc.strerror})") \
            from None


def request(address: str, message: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(_sockaddr(address))
        except OSError as exc:
            raise ControlError(f"cannot reach the daemon at {address}: {exc.strerror}") \
                from None
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    response = json.loads(data)
    if "error" in response:
        raise ControlError(f"the daemon refused: {response['error']}")
    return response


def _in_place(s: dict) -> str:
    """The note " (N in place)" where shards are read from their own files (--in-place)."""
    linked = s.get("shards_in_place") or 0
    return f" ({linked} in place)" if linked else ""


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def format_stats(s: dict[str, Any]) -> str:
    r, src = s["reader"], s["source"]
    # GETs a proxy (or an answer h1 leaves to httpx) sent the slow way: docs/sources.md
    through_httpx = f", {src['httpx_requests']} through httpx" if src.get("httpx_requests") else ""
    ratio = s["amplification"]
    hit = s["hit_ratio"]
    lines = [
        f"mountpoint      {s['mountpoint']} (pid {s['pid']}, up {s['uptime_s']:.0f} s)",
        f"sources         {', '.join(s.get('sources', []))}",
        f"shards          {s['shards']} indexed, {s['shards_cached']} cached"
        f"{_in_place(s)}, "
        f"{s['shards_fetching']} fetching; {s['files']} files, "
        f"{_fmt_bytes(s['dataset_bytes'])}",
        f"cache           {_fmt_bytes(s['cache_used_bytes'])} of "
        f"{_fmt_bytes(s['cache_budget_bytes'])} ({s['evictions']} evictions) in "
        f"{s.get('cache_dir', '?')}",
        f"served          {_fmt_bytes(s['bytes_served'])} in {r['reads']} reads, "
        f"{_fmt_bytes(s.get('throughput_bps', 0))}/s now",
        f"fetched         {_fmt_bytes(s['bytes_fetched'])} "
        f"(amplification {'-' if ratio is None else f'{ratio:.2f}'}x; "
        f"indexing {_fmt_bytes(s['bytes_indexed'])})",
        f"hit ratio       {'-' if hit is None else f'{100 * hit:.1f} %'} "
        f"(cache {r['cache_hits']}, in-flight {r['frontier_hits']}, waited {r['waits']}, "
        f"member fetches {r['member_fetches']}, member hits {r.get('member_hits', 0)})",
        f"requests        {src['requests']} ({src['retries']} retries, {src['errors']} errors"
        f"{through_httpx}); "
        f"fetch errors {r['fetch_errors']}, EIO {r['eio']}",
    ]
    if s.get("connection_kept_by"):  # a mount that outlives its daemon (docs/design.md)
        holder = f" (pid {s['holder_pid']})" if s.get("holder_pid") else ""
        lines.append(f"takeovers       {s.get('takeovers', 0)}; connection kept by "
                     f"{s['connection_kept_by']}{holder}")
    if r.get("resumed_fetches"):  # downloads an earlier daemon left, continued
        lines.append(f"continued       {r['resumed_fetches']} download(s) an earlier daemon "
                     f"left: {_fmt_bytes(r['resumed_bytes'])} kept, "
                     f"{_fmt_bytes(r['resume_rejected_bytes'])} failed their check")
    if "reads_in_flight" in s:  # what `shardfs top` follows live
        cpu = s.get("cpu_s") or {}
        lines.append(f"now             {s['reads_in_flight']} reads waiting (oldest "
                     f"{s['oldest_read_s']:.2f} s); fetching {_fmt_bytes(s['fetch_bps'])}/s "
                     f"(best {_fmt_bytes(s['link_peak_bps'])}/s); CPU daemon "
                     f"{cpu.get('daemon', 0):.1f} s, workers {cpu.get('workers', 0):.1f} s")
    if src.get("throttled") or src.get("budget_waits"):
        lines.append(f"throttling      {src['throttled']} slow-down answers; "
                     f"{src['budget_waits']} requests waited "
                     f"{src['budget_wait_s']:.1f} s for the request budget")
    if src.get("credential_providers"):
        names = ", ".join(f"{k}: {v}" for k, v in src["credential_providers"].items())
        lines.append(f"credentials     {names} ({src['credential_refreshes']} refreshes)")
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    try:
        snapshot = read_stats(os.path.abspath(args.mountpoint))
    except ControlError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(snapshot, indent=2) if args.json else format_stats(snapshot))
    return 0


def run_warm(args: argparse.Namespace) -> int:
    try:
        for path in args.paths:
            if not os.path.exists(path):
                raise ControlError(f"{path} does not exist")
        mountpoint = shardfs_root(args.paths[0])
        if mountpoint is None:
            raise ControlError(f"{os.path.abspath(args.paths[0])} is not in a shardfs mount")
        snapshot = read_stats(mountpoint)
        rel = []
        for path in args.paths:
            full = os.path.realpath(path)
            if shardfs_root(full) != mountpoint:
                raise ControlError(f"{path} is not under the mount {mountpoint}")
            rel.append(os.path.relpath(full, mountpoint))
        sock = snapshot["control_socket"]
        plan = request(sock, {"cmd": "warm", "paths": rel})
        print(f"warming {len(plan['shards'])} shards ({_fmt_bytes(plan['bytes'])}); "
              f"{plan['already_cached']} already cached"
              + (f"; {plan['over_budget']} left out: they do not fit the cache budget"
                 if plan["over_budget"] else ""))
        if args.no_wait or not plan["shards"]:
            return 0
        progress = ProgressLine("warming shards")
        while True:
            state = request(sock, {"cmd": "progress", "shards": plan["shards"]})
            progress.update("warm", state["cached"] + state["failed"], state["total"])
            if state["cached"] + state["failed"] >= state["total"] or state["idle"]:
                break
            time.sleep(0.5)
        progress.close()
    except ControlError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nshardfs: stopped waiting; the daemon keeps fetching", file=sys.stderr)
        return 130
    print(f"{state['cached']} of {state['total']} shards cached"
          + (f", {state['failed']} failed (see the daemon log)" if state["failed"] else ""))
    return 1 if state["failed"] else 0
