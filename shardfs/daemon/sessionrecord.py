"""The session record: what a new daemon needs to take a live mount over (docs/design.md,
"A mount that outlives its daemon").

Written by the daemon into its cache dir (`session.json`) once the kernel's INIT is answered,
and again after each takeover; read by a daemon started with `--fuse-fd N --takeover`. With
it, any process holding a descriptor of the connection can start a takeover from that
descriptor and the cache dir alone: the record holds the INIT request as the kernel sent it
(libfuse is made to process it again, see fuse/session.py `resume`) and the identities of the
shards whose tree the kernel has seen (inode numbers are positions in that tree, so the new
daemon must serve the very same tree, whatever the sources say now).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardfs.sources.base import ShardInfo

RECORD_NAME = "session.json"
FORMAT = "shardfs-session-1"
# fuse_in_header (40 bytes), then fuse_init_in: major, minor, max_readahead, flags, flags2
_IN_HEADER = struct.Struct("=IIQQIIIHH")
_INIT_IN = struct.Struct("=IIIII")
FUSE_INIT = 26


class RecordError(Exception):
    """No usable session record: the message says why."""


def describe_init(request: bytes) -> dict[str, int]:
    """The fields of a FUSE INIT request, for people reading the record."""
    if len(request) < _IN_HEADER.size + _INIT_IN.size:
        raise RecordError(f"INIT request of {len(request)} bytes is too short")
    length, opcode, unique, *_ = _IN_HEADER.unpack_from(request)
    if opcode != FUSE_INIT or length != len(request):
        raise RecordError(f"not an INIT request (opcode {opcode}, length {length})")
    major, minor, readahead, flags, flags2 = _INIT_IN.unpack_from(request, _IN_HEADER.size)
    return {"unique": unique, "major": major, "minor": minor, "max_readahead": readahead,
            "flags": flags | (flags2 << 32)}


@dataclass(slots=True)
class SessionRecord:
    mountpoint: str
    init_request: bytes  # fuse_in_header + fuse_init_in exactly as the kernel sent them
    shards: list[ShardInfo]  # the identities of the tree the kernel has seen
    fuse_options: list[str]
    pid: int = field(default_factory=os.getpid)  # the daemon that wrote it
    takeovers: int = 0  # how many daemons took this mount over since it was made
    mounted_at: float = field(default_factory=time.time)
    libfuse: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "mountpoint": self.mountpoint,
            "pid": self.pid,
            "takeovers": self.takeovers,
            "mounted_at": self.mounted_at,
            "written_at": time.time(),
            "libfuse": self.libfuse,
            "fuse_options": sorted(self.fuse_options),
            "init": describe_init(self.init_request),
            "init_request": base64.b64encode(self.init_request).decode(),
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionRecord:
        if data.get("format") != FORMAT:
            raise RecordError(f"unknown format {data.get('format')!r} (expected {FORMAT})")
        try:
            request = base64.b64decode(data["init_request"])
            describe_init(request)
            return cls(mountpoint=data["mountpoint"], init_request=request,
                       shards=[ShardInfo(**s) for s in data["shards"]],
                       fuse_options=list(data["fuse_options"]), pid=int(data["pid"]),
                       takeovers=int(data["takeovers"]),
                       mounted_at=float(data["mounted_at"]), libfuse=str(data["libfuse"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"damaged record: {type(exc).__name__}: {exc}") from None


def record_path(cache_dir: Path) -> Path:
    return cache_dir / RECORD_NAME


def write_record(cache_dir: Path, record: SessionRecord) -> None:
    """Atomically (a reader never sees half a record), readable by the daemon's user only."""
    path = record_path(cache_dir)
    tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_record(cache_dir: Path) -> SessionRecord:
    path = record_path(cache_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"no session record {path}: the mount was not made by a daemon "
                          "using this cache dir") from None
    except (OSError, ValueError) as exc:
        raise RecordError(f"cannot read {path}: {exc}") from None
    return SessionRecord.from_json(data)


def remove_record(cache_dir: Path) -> None:
    record_path(cache_dir).unlink(missing_ok=True)
