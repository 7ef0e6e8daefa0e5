"""The S3 store of the `s3` scenario: SeaweedFS (the tests' S3 server, signatures checked)
behind an emulated link.

- Per-request latency: SeaweedFS has none of its own and this kernel has no netem, so an nginx
  (C, its own processes) sits in front as a reverse proxy whose every request first waits on
  a non-blocking timer (the echo module's `echo_sleep`, as the HTTP bench does), then is passed
  on over kept-alive upstream connections with the client's Host header, so SigV4 signatures
  made for the proxy's address verify at SeaweedFS. Its access log counts requests and bytes
  per epoch. Its CPU is the "server" CPU, beside SeaweedFS's, never the loader's or daemon's.
- Bandwidth: `tc` shapes only the replies leaving the proxy's port (bench/server.py's
  `PortCap`, as for the HTTP bench: an htb class for that source port with the tbf under
  it); SeaweedFS's internal traffic (filer, volume server, proxy upstream) on the same
  loopback is not capped.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardfs.devtools.nginx import Nginx


class S3Proxy(Nginx):
    """nginx passing every request to `upstream` after `latency_s` (0: no delay)."""

    def __init__(self, upstream_port: int, workdir: Path, *, latency_s: float,
                 workers: int = 2) -> None:
        super().__init__(workdir, workdir, latency_s=latency_s, workers=workers)
        self.upstream_port = upstream_port

    worker_connections = 4096
    named_location = "s3"

    def _serve(self) -> str:
        return """proxy_pass http://s3;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;"""

    def _http_settings(self) -> str:
        return f"""    client_max_body_size 0;
    upstream s3 {{
        server 127.0.0.1:{self.upstream_port};
        keepalive 64;
    }}"""


def tree_pids(root: int | None) -> list[int]:
    """`root` and every live descendant (by /proc PPid)."""
    if not root:
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_seconds(root: int | None) -> float | None:
    """utime + stime of `root` and its live descendants (nginx master + workers)."""
    from bench.procs import cpu_seconds

    pids = tree_pids(root)
    if not pids:
        return None
    return sum(cpu_seconds(p) or 0.0 for p in pids)


def tree_rss_bytes(root: int | None, field: str = "VmHWM") -> int | None:
    from bench.procs import peak_rss

    vals = [peak_rss(p, field) or 0 for p in tree_pids(root)]
    return sum(vals) or None
