"""The remote store for the benchmark: shardfs's devtools nginx on 127.0.0.1 (latency via the
echo module, directory listings for the per-file HTTP mounts), and an optional loopback
bandwidth cap (tc tbf) that is always removed."""

from __future__ import annotations

import atexit
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from shardfs.devtools.nginx import AccessRecord, Nginx


@dataclass
class Traffic:
    requests: int = 0
    bytes: int = 0
    errors: int = 0  # responses with status >= 400

    @classmethod
    def of(cls, records: list[AccessRecord]) -> Traffic:
        return cls(requests=len(records), bytes=sum(r.bytes_sent for r in records),
                   errors=sum(1 for r in records if r.status >= 400))

    def as_dict(self) -> dict:
        return {"requests": self.requests, "bytes": self.bytes, "errors": self.errors}


class BandwidthCap:
    """`tc qdisc add dev lo root tbf ...` for the duration of a `with` block.

    Removed in __exit__ and, as a backstop, at interpreter exit. If tc is missing or refuses
    (no CAP_NET_ADMIN, a qdisc already there), `active` stays False and `error` says why: the
    benchmark then runs uncapped and says so.
    """

    def __init__(self, rate: str | None, burst: str = "1mb", latency: str = "100ms",
                 dev: str = "lo") -> None:
        self.rate, self.burst, self.latency, self.dev = rate, burst, latency, dev
        self.active = False
        self.error: str | None = None

    def __enter__(self) -> Self:
        if not self.rate:
            self.error = "disabled (--no-tc)"
            return self
        tc = shutil.which("tc")
        if tc is None:
            self.error = "tc not found (apt-get install iproute2)"
            return self
        existing = subprocess.run([tc, "qdisc", "show", "dev", self.dev], capture_output=True,
                                  text=True)
        if " root " in existing.stdout and "noqueue" not in existing.stdout:
            # Someone else's root qdisc: never replace (or later delete) what is not ours.
            self.error = f"a root qdisc is already set on {self.dev}: {existing.stdout.strip()}"
            return self
        self.error = self._install(tc)
        if self.error is not None:
            return self
        self.active = True
        atexit.register(self.remove)
        return self

    def _install(self, tc: str) -> str | None:
        """Adds the qdiscs (lo is free of a root qdisc); why not, or None when done."""
        assert self.rate is not None
        cmd = [tc, "qdisc", "add", "dev", self.dev, "root", "tbf", "rate", self.rate,
               "burst", self.burst, "latency", self.latency]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            return f"{' '.join(cmd)} failed: {result.stderr.strip()}"
        return None

    def remove(self) -> None:
        if self.active:
            self.active = False
            subprocess.run(["tc", "qdisc", "del", "dev", self.dev, "root"], capture_output=True)

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def sent_bytes(self) -> int | None:
        """Bytes the cap has let through so far (tc's "Sent" counter), None when uncapped.

        This is what crossed the link. nginx's access log counts what nginx handed to its
        socket, which includes a send buffer (up to `net.ipv4.tcp_wmem`, 4 MiB) that a client
        closing the connection early never receives."""
        if not self.active:
            return None
        out = subprocess.run(["tc", "-s", "qdisc", "show", "dev", self.dev],
                             capture_output=True, text=True).stdout
        return self._sent_of(out)

    def _sent_of(self, tc_stats: str) -> int | None:
        """`tc -s qdisc show` output -> the bytes this cap let through."""
        return parse_tc_sent(tc_stats)

    @property
    def bytes_per_s(self) -> float | None:
        return parse_rate(self.rate) if self.active and self.rate else None

    def describe(self) -> str:
        if self.active:
            return (f"tc tbf rate {self.rate} burst {self.burst} latency {self.latency} "
                    f"on {self.dev}")
        return f"uncapped: {self.error}"


class PortCap(BandwidthCap):
    """A tbf cap on the packets leaving one TCP port on lo (the server's replies), for the
    duration of a `with`: a full-duplex link, where requests do not queue behind the replies
    that fill it (with BandwidthCap's one FIFO for both directions they did: a member GET's
    first byte came ~45 ms after it was asked for at nginx's 20 ms, against ~33 ms with this
    cap; docs/benchmarks-notes.md), and other loopback traffic goes by uncapped.

    htb root (default class: unshaped) + a class for `sport == port` with tbf under it. Removed
    in __exit__ and at interpreter exit; a root qdisc that is not ours is never touched (the
    run then goes uncapped and says why)."""

    def __init__(self, port: int, rate: str | None, burst: str = "1mb",
                 latency: str = "100ms", dev: str = "lo") -> None:
        super().__init__(rate, burst, latency, dev)
        self.port = port

    def _install(self, tc: str) -> str | None:
        assert self.rate is not None
        d = self.dev
        steps = [
            ["qdisc", "add", "dev", d, "root", "handle", "1:", "htb", "default", "20"],
            ["class", "add", "dev", d, "parent", "1:", "classid", "1:10", "htb", "rate",
             "100gbit", "quantum", "200000"],
            ["class", "add", "dev", d, "parent", "1:", "classid", "1:20", "htb", "rate",
             "100gbit", "quantum", "200000"],
            ["qdisc", "add", "dev", d, "parent", "1:10", "handle", "10:", "tbf", "rate",
             self.rate, "burst", self.burst, "latency", self.latency],
            ["filter", "add", "dev", d, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "sport", str(self.port), "0xffff", "flowid", "1:10"],
        ]
        for i, step in enumerate(steps):
            r = subprocess.run([tc, *step], capture_output=True, text=True)
            if r.returncode != 0:
                if i > 0:
                    subprocess.run([tc, "qdisc", "del", "dev", d, "root"], capture_output=True)
                return f"tc {' '.join(step)} failed: {r.stderr.strip()}"
        return None

    def _sent_of(self, tc_stats: str) -> int | None:
        """The tbf's count: replies from the port."""
        return parse_tbf_sent(tc_stats, "10:")

    def describe(self) -> str:
        if self.active:
            return (f"tc tbf rate {self.rate} burst {self.burst} latency {self.latency} on "
                    f"{self.dev}, replies from port {self.port} only")
        return f"uncapped: {self.error}"


def parse_tbf_sent(text: str, handle: str) -> int | None:
    """`tc -s qdisc show` -> the "Sent N bytes" of the qdisc with `handle` (e.g. "10:")."""
    mine = False
    for line in text.splitlines():
        words = line.split()
        if line.startswith("qdisc "):
            mine = len(words) >= 3 and words[2] == handle
        elif mine and len(words) >= 3 and words[0] == "Sent" and words[2] == "bytes":
            return int(words[1])
    return None


def parse_tc_sent(text: str) -> int | None:
    """`tc -s qdisc show` output -> the root qdisc's "Sent N bytes" (None if absent)."""
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] == "Sent" and words[2] == "bytes":
            return int(words[1])
    return None


def parse_rate(text: str) -> float:
    """tc rate -> bytes/s: '800mbit' -> 1e8; 'mbps' is megabytes/s (tc's convention)."""
    t = text.strip().lower()
    units = [("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("gbps", 1e9),
             ("mbps", 1e6), ("kbps", 1e3), ("bit", 1 / 8), ("bps", 1.0)]
    for suffix, factor in units:
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * factor
    return float(t) / 8  # tc: a bare number is bits/s


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def listing_nginx(root: Path, workdir: Path, latency_s: float) -> Nginx:
    """nginx with `autoindex on` (rclone's http remote lists directories) and 2 workers."""
    return Nginx(root, workdir, latency_s=latency_s, listings=True, workers=2)
