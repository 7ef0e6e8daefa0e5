"""The mount lifecycle: index, mount, announce readiness, serve, unmount cleanly on signals."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import Catalog, open_catalog
from shardfs.catalog.resolve import resolve_sources
from shardfs.daemon.announce import announce_address, attach_lookahead, serve_announcements
from shardfs.daemon.control import control_address, serve_control
from shardfs.daemon.handover import hand_over, holder_pid, keeper
from shardfs.daemon.mountpoint import is_mounted, listed_mount, unmount
from shardfs.daemon.notify import sd_notify
from shardfs.daemon.sessionrecord import (
    SessionRecord,
    describe_init,
    read_record,
    remove_record,
    write_record,
)
from shardfs.daemon.workers import WorkerPool, Zygote, worker_address
from shardfs.fuse import session as fuse_session
from shardfs.fuse import shim
from shardfs.fuse.arenareads import ArenaReads, in_c_wanted
from shardfs.fuse.fastread import COLLECT_INTERVAL, FastReads, next_interval
from shardfs.fuse.ops import ShardFS
from shardfs.fuse.pagepush import PagePusher, worth_pushing
from shardfs.fuse.worker import (
    WorkerSetup,
    fuse_session_alive,
    not_a_late_answer,
    resend_unanswered,
    run_worker,
)
from shardfs.read.inplace import link_in_place
from shardfs.read.lookahead import Lookahead, LookaheadPolicy
from shardfs.read.reader import Reader, ReadPolicy
from shardfs.read.states import ShardStates
from shardfs.sources import ShardInfo, Sources, SourceSettings
from shardfs.sources.http import renewal_advice, signatures_expire
from shardfs.util.gcfreeze import freeze_startup_objects
from shardfs.util.proc import cpu_seconds
from shardfs.util.progress import ProgressLine
from shardfs.util.sizes import format_duration, format_utc
from shardfs.util.urls import EXPIRES_SOON_S, earliest_signed_until, redact

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed
# Exit without unmounting, for a new daemon to take over (systemd's RestartKillSignal=).
HANDOVER_SIGNAL = signal.SIGUSR1
# The stats ride on an xattr, at most 64 KiB (XATTR_SIZE_MAX): a mount given thousands of
# URLs lists its first sources up to this many bytes, and their count beside them.
SOURCES_SHOWN_BYTES = 16 << 10
STATUS_INTERVAL = 5.0  # seconds between STATUS= updates to systemd and metrics snapshots


@dataclass(slots=True)
class MountConfig:
    specs: list[str]  # SOURCEs as the user wrote them (patterns, manifests, prefixes)
    mountpoint: str
    cache_dir: Path
    cache_size: int
    settings: SourceSettings = field(default_factory=SourceSettings)
    policy: ReadPolicy = field(default_factory=ReadPolicy)
    lookahead: LookaheadPolicy = field(default_factory=LookaheadPolicy)
    index_parallel: int = 8
    warm_while_indexing: bool = True
    # Plain file:// shards read from their own files, not copied (read/inplace.py): off, on,
    # or auto (those on a local file system).
    in_place: str = "auto"
    # Fetched shards' files into the kernel's page cache when worth it (fuse/pagepush.py).
    push_pages: bool = True
    allow_other: bool = False
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    log_level: str = "info"
    log_file: str | None = None
    metrics_listen: str | None = None
    max_tasks: int = 256  # concurrent FUSE requests in flight (readers waiting on fetches)
    workers: int = 1  # FUSE worker processes; 1: the daemon serves requests itself
    detached: bool = False  # daemonized: output goes to log_path once ready
    # An open /dev/fuse descriptor another process mounted (--fuse-fd); None: mount here.
    fuse_fd: int | None = None
    takeover: bool = False  # the connection's INIT was answered by an earlier daemon
    # Called just before a takeover first touches the connection (the holder's handshake).
    before_takeover: Callable[[], None] | None = None

    @property
    def log_path(self) -> str:
        return self.log_file or str(self.cache_dir / "shardfs.log")

    @property
    def control_socket(self) -> str:
        return control_address(str(self.cache_dir))

    @property
    def lookahead_socket(self) -> str:
        return announce_address(str(self.cache_dir))


def fuse_options(cfg: MountConfig) -> set[str]:
    options = {"fsname=shardfs", "subtype=shardfs", "ro", "default_permissions", "noatime"}
    if cfg.allow_other:
        options.add("allow_other")
    return options


class Throughput:
    """Bytes served per second over the last ~10 s, from periodic samples."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=11)

    def sample(self, served: int) -> None:
        self._samples.append((time.monotonic(), served))

    def rate(self, served: int) -> float:
        now = time.monotonic()
        if not self._samples:
            return 0.0
        t0, b0 = self._samples[0]
        return (served - b0) / (now - t0) if now > t0 else 0.0


class LinkRate:
    """Bytes fetched per second over the last few samples, and the best such rate seen: the
    link's capacity as far as this mount has measured it (`shardfs top` shows one against
    the other)."""

    WINDOW_S = 2.5  # a rate over less time is noise (one shard's burst)

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque(maxlen=4)
        self.peak = 0.0

    def sample(self, fetched: int) -> None:
        self._samples.append((time.monotonic(), fetched))
        rate = self.rate()
        if rate is not None:
            self.peak = max(self.peak, rate)

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 - t0 >= self.WINDOW_S else None


def shown_sources(specs: list[str]) -> list[str]:
    """The first of a mount's sources, redacted (no signed URL's token), up to
    SOURCES_SHOWN_BYTES (always the first one); the rest are not looked at (the snapshot is
    taken every second)."""
    shown: list[str] = []
    size = 0
    for spec in map(redact, specs):
        size += len(spec.encode("utf-8", "surrogateescape")) + 4  # quotes, comma, space
        if shown and size > SOURCES_SHOWN_BYTES:
            break
        shown.append(spec)
    return shown


def _cpu_of(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


@dataclass(slots=True)
class SessionState:
    """This daemon's FUSE session as far as takeovers go."""

    takeovers: int = 0  # daemons that took the mount over before and including this one
    can_take_over: bool = False  # a session record was written: a new daemon can adopt it
    keeper: str | None = None  # who holds a copy of the connection: "holder", "systemd"
    leave_mounted: bool = False  # SIGUSR1: exit for a new daemon to take over (a restart)
    mounted_at: float = field(default_factory=time.time)


@dataclass(slots=True)
class Mounted:
    """Everything a running mount has, for stats, control requests and metrics."""

    cfg: MountConfig
    catalog: Catalog
    cache: ShardCache
    reader: Reader
    sources: Sources
    started: float = field(default_factory=time.monotonic)
    throughput: Throughput = field(default_factory=Throughput)
    link: LinkRate = field(default_factory=LinkRate)
    shim: bool = False  # the pyfuse3 shim is in effect (no OPEN, metadata and reads in C)
    latest: dict[str, Any] = field(default_factory=dict)  # read by the metrics thread
    workers: WorkerPool | None = None
    ops: ShardFS | None = None  # when the daemon answers FUSE requests itself
    lookahead: Lookahead | None = None  # announced reads (shardfs.torch.Lookahead)
    pusher: PagePusher | None = None  # fetched shards into the page cache
    session: SessionState = field(default_factory=lambda: SessionState())

    arena_reads: ArenaReads | None = None  # the Lookahead's members read in C here
    # When the signatures in the shards' URLs expire (the earliest; None: none says)
    urls_signed_until: float | None = None

    def __post_init__(self) -> None:
        self.urls_signed_until = earliest_signed_until(s.url for s in self.catalog.shards)

    def signed_until(self) -> float | None:
        """The earliest expiry of the shards' signed URLs and of the URL query in effect
        (renewed from its file, see sources/http.py)."""
        times = [t for t in (self.urls_signed_until, self.sources.url_query_until())
                 if t is not None]
        return min(times, default=None)

    def collect_fast_reads(self) -> bool:
        """Count the reads the shim answered in C in this process (bytes on disk, in the
        page cache, members in the Lookahead's arena) as the reader's own: stats, working set,
        LRU order; the arena's also as the Lookahead's hits. False if none."""
        fast = self.ops.fast if self.ops is not None else None
        if fast is None:
            return False
        got = fast.collect()
        if got.shards:
            self.reader.note_reads("c", got.shards, got.nbytes, got.complete, got.frontier)
            self.reader.disk.in_c += len(got.shards)
        taken = self.arena_reads.collect() if self.arena_reads is not None else []
        if taken:
            self.reader.note_reads("c", [t[0] for t in taken], sum(t[3] for t in taken), 0, 0)
            assert self.lookahead is not None
            for shard, member_off, at, nbytes in taken:
                self.lookahead.taken(shard, member_off, at, nbytes, in_c=True)
        return bool(got.shards or taken)

    async def keep_arena_reads(self) -> None:
        """The daemon serving alone: once a training process announces, the Lookahead keeps
        its members in a shared arena that this process's shim maps too, and is told where
        each landed and which left, so the reader thread answers their READs in C as a
        worker's shim does (fuse/arenareads.py). Runs until cancelled; returns if no arena
        can be had (Python serves those reads, as before)."""
        lookahead = self.lookahead
        assert lookahead is not None
        while True:
            await lookahead.published.wait()
            lookahead.published = trio.Event()
            if self.arena_reads is None:
                if not lookahead.stats.connections:
                    continue
                shared = lookahead.share()
                if shared is None:
                    return
                try:
                    self.arena_reads = ArenaReads(*shared)
                except OSError as exc:
                    log.warning("arena reads stay in Python: %s", exc)
                    return
            landed, gone = lookahead.landed, lookahead.gone
            lookahead.landed, lookahead.gone = [], []
            self.arena_reads.landed(landed)
            self.arena_reads.gone(gone)

    async def keep_fast_reads(self) -> None:
        """Collect C reads and close descriptors of evicted shards; runs until cancelled."""
        assert self.ops is not None and self.ops.fast is not None
        interval = COLLECT_INTERVAL
        while True:
            await trio.sleep(interval)
            self.ops.fast.close_stale()
            interval = next_interval(interval, self.collect_fast_reads())

    def snapshot(self) -> dict[str, Any]:
        self.collect_fast_reads()
        session = self.session
        rs, catalog, cache = self.reader.stats, self.catalog, self.cache
        fetched = self.bytes_fetched()
        in_flight, oldest = self.reader.in_flight()
        settings = self.cfg.settings
        times = os.times()
        return {
            "mountpoint": self.cfg.mountpoint,
            "pid": os.getpid(),
            "workers": self.workers.pids if self.workers is not None else [],
            "worker_count": len(self.workers.pids) if self.workers is not None else 0,
            "worker_restarts": self.workers.restarts if self.workers is not None else 0,
            # OPEN requests: with the shim in effect only the first one (answered ENOSYS)
            "opens": (self.ops.opens if self.ops is not None else 0)
            + (self.workers.opens if self.workers is not None else 0),
            # IOCTL requests answered in C (Python's open() asks isatty() of each file)
            "ioctls": shim.ioctls_answered()
            + (self.workers.ioctls if self.workers is not None else 0),
            "fuse_requests": _fuse_requests(self.workers),
            "uptime_s": round(time.monotonic() - self.started, 3),
            # daemons that took this mount over from a dead or replaced one (--takeover)
            "takeovers": session.takeovers,
            "takeover_ready": session.can_take_over,
            "connection_kept_by": session.keeper,
            "holder_pid": holder_pid() if session.keeper == "holder" else None,
            "sources": shown_sources(self.cfg.specs),
            "sources_total": len(self.cfg.specs),
            "signed_until": self.signed_until(),  # Unix time: when reads would be refused
            "cache_dir": str(self.cfg.cache_dir),
            "control_socket": self.cfg.control_socket,
            "shards": len(catalog.shards),
            "files": catalog.tree.count_files(),
            "dataset_bytes": self.reader.dataset_bytes,
            "fetched_bytes": self.reader.fetched_bytes,  # of those: not read in place
            "shards_cached": cache.complete_count,
            "shards_in_place": cache.linked_count,  # of those: links to their own files
            "in_place": self.cfg.in_place,  # the setting: off, on or auto
            "shards_fetching": len(self.reader.fetches),
            "working_set_reads": self.reader.window,
            # Bytes of the shards in the working set: whole shards are cached only while this
            # fits cache_budget_bytes (or the whole dataset does).
            "working_set_bytes": self.reader.working_set.nbytes,
            "cache_used_bytes": cache.used,
            "cache_budget_bytes": cache.budget,
            "evictions": cache.evictions,
            "evicted_bytes": cache.evicted_bytes,
            "members_skipped": catalog.skipped,
            "paths_shadowed": catalog.tree.report.shadowed,
            "bytes_fetched": fetched,
            "bytes_indexed": catalog.indexed_bytes,
            "bytes_served": rs.bytes_served,
            "throughput_bps": round(self.throughput.rate(rs.bytes_served)),
            "amplification": round(fetched / rs.bytes_served, 4) if rs.bytes_served else None,
            "hit_ratio": round((rs.cache_hits + rs.frontier_hits) / rs.reads, 4)
            if rs.reads else None,
            "reader": asdict(rs),
            # cache file reads: from the page cache in C (the shim) or on the loop, or in a
            # thread (disk)
            "disk_reads": {"in_c": self.reader.disk.in_c, "inline": self.reader.disk.inline,
                           "threaded": self.reader.disk.threaded},
            "source": asdict(self.sources.stats()),
            "lookahead_socket": self.cfg.lookahead_socket if self.lookahead else None,
            "lookahead": self.lookahead.snapshot() if self.lookahead else None,
            "pages_pushed": self.pusher.snapshot() if self.pusher else None,
            # For `shardfs top` and `shardfs doctor` (docs/tuning.md, "My training is slow").
            "shim": self.shim,
            "reads_in_flight": in_flight,  # reads the daemon is answering now (waiting)
            "oldest_read_s": 0.0 if oldest is None else round(oldest, 3),
            "member_fetches_in_flight": self.reader.member_fetches_in_flight,
            "fetch_bps": round(self.link.rate() or 0),
            "link_peak_bps": round(self.link.peak),
            "cpu_s": {"daemon": round(times.user + times.system, 2),
                      "workers": round(_cpu_of(self.workers.pids), 2)
                      if self.workers is not None else 0.0},
            # Where the sources are (never credentials): what `shardfs doctor MOUNTPOINT` uses.
            "source_settings": {k: getattr(settings, k) for k in (
                "timeout", "deadline", "s3_endpoint", "s3_region", "s3_profile",
                "s3_addressing", "ais_endpoint", "hf_endpoint", "gs_endpoint",
                "url_query_file")},
        }

    def bytes_fetched(self) -> int:
        rs = self.reader.stats
        fetched = rs.shard_bytes + rs.member_bytes + self.catalog.indexed_bytes
        if self.lookahead is not None:
            fetched += self.lookahead.stats.bytes_fetched
        return fetched

    async def snapshot_json(self) -> bytes:
        if self.workers is not None:
            await self.workers.flush()  # count the reads workers served until now
        return json.dumps(self.snapshot()).encode()

    @staticmethod
    def status_line(s: dict[str, Any]) -> str:
        """systemd's STATUS= line from a snapshot (`snapshot()`)."""
        hit = "-" if s["hit_ratio"] is None else f"{100 * s['hit_ratio']:.0f}%"
        return (f"{s['shards_cached']}/{s['shards']} shards cached, "
                f"{s['bytes_fetched'] / 1e9:.2f} GB fetched, {s['bytes_served'] / 1e9:.2f} GB "
                f"served, hit ratio {hit}")

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Control socket requests: stats, warm, progress."""
        cmd = request.get("cmd")
        if cmd == "stats":
            if self.workers is not None:
                await self.workers.flush()
            return self.snapshot()
        if cmd == "warm":
            tree = self.catalog.tree
            shards: dict[int, None] = {}
            for rel in request.get("paths") or ["."]:
                ino = tree.resolve(os.fsencode(os.path.normpath(rel)).lstrip(b"/"))
                if ino is None or rel.startswith(".."):
                    raise ValueError(f"{rel!r} is not in the mounted tree")
                shards.update(dict.fromkeys(tree.shards_under(ino)))
            plan = self.reader.warm(list(shards))
            log.info("warm: %d shards queued (%d bytes), %d already cached, %d over budget",
                     len(plan["shards"]), plan["bytes"], plan["already_cached"],
                     plan["over_budget"])
            return plan
        if cmd == "progress":
            return self.reader.warm_progress([int(s) for s in request.get("shards", [])])
        raise ValueError(f"unknown command {cmd!r}")


async def _probe_ready(mountpoint: str) -> None:
    """Returns once the kernel gets answers from us (the INIT handshake is done)."""
    await trio.to_thread.run_sync(os.statvfs, mountpoint)


def _indexing_progress(line: ProgressLine) -> Callable[..., None]:
    def update(phase: str, done: int, total: int, detail: str = "") -> None:
        line.update(phase, done, total, detail)
        sd_notify(f"STATUS=indexing shards: {done}/{total}")

    return update


class Interrupted(Exception):
    """A stop signal arrived before the mount was ready."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


async def _interruptible(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """`fn(*args)`, cancelled by SIGINT/SIGTERM/SIGHUP, which then raise Interrupted: fetches
    in flight are aborted and their partial files dropped."""
    with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                async for signum in signals:
                    raise Interrupted(signum)

            nursery.start_soon(watch)
            result = await fn(*args)
            nursery.cancel_scope.cancel()
    return result


def _raise_fd_limit() -> None:
    """Descriptors: each process of a mount keeps one per shard it reads from the cache (the
    cache's own, and one more for the reads answered in C), so a dataset of thousands of
    shards needs more than the usual soft limit of 1024. Raise it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _fuse_requests(workers: WorkerPool | None) -> dict[str, int]:
    """FUSE requests the shim's reader threads answered in C, and handed to pyfuse3: this
    process's and its workers'."""
    in_c, to_python = shim.reader_counts()
    if workers is not None:
        in_c += workers.fuse_requests[0]
        to_python += workers.fuse_requests[1]
    return {"in_c": in_c, "to_python": to_python}


def run(cfg: MountConfig, cache: ShardCache, on_ready: Callable[[str], None]) -> None:
    """Index, mount and serve until unmounted or signalled (the daemon's whole life).

    Three phases: the catalog (a trio loop of its own: network, indexing), the mount (no loop:
    with workers, INIT is answered and the worker zygote forked here, before any thread of
    the serving loop exists), then serving (a second trio loop)."""
    _raise_fd_limit()
    record = read_record(cfg.cache_dir) if cfg.takeover else None
    indexing_sources = Sources(cfg.settings)
    catalog = trio.run(_interruptible, _open_catalog, cfg, cache, indexing_sources,
                       record.shards if record is not None else None)
    # A shard's name in its files' xattrs: its URL with any signature redacted (anyone who
    # may read the mount reads them; the samplers use them only to group files by shard).
    ops = ShardFS(catalog.tree, None, [redact(s.url) for s in catalog.shards], uid=cfg.uid,
                  gid=cfg.gid)
    session = SessionState(keeper=keeper())  # who will keep it (stats may be asked at once)
    if record is not None:
        assert cfg.fuse_fd is not None
        _test_takeover_delay()
        if cfg.before_takeover is not None:
            cfg.before_takeover()
        ops.no_open = _take_over(ops, cfg, record)
        session.takeovers = record.takeovers + 1
        session.mounted_at = record.mounted_at
    else:
        ops.no_open = fuse_session.mount(ops, cfg.mountpoint, fuse_options(cfg),
                                         fuse_fd=cfg.fuse_fd)
        if cfg.fuse_fd is not None and ops.no_open:
            # The kernel sent INIT when the descriptor was mounted: answer it now, so the
            # record is written even where this namespace cannot see the mount to probe it.
            fuse_session.answer_init()
    states = ShardStates(len(catalog.shards))
    zygote = None
    try:
        if cfg.workers > 1:
            if ops.no_open:
                if record is None and cfg.fuse_fd is None:
                    fuse_session.answer_init()
                setup = WorkerSetup(ops, states, cache.shards_dir, catalog.keys,
                                    sum(catalog.cached_sizes()),
                                    worker_address(cfg.control_socket, os.getpid()), cfg.max_tasks)
                zygote = Zygote(lambda clone: run_worker(setup, clone),
                                keep_fds=tuple(fd for fd in (shim.session_fd(),
                                                             shim.reader_wait_fd()) if fd >= 0),
                                log_path=cfg.log_path if cfg.detached else None)
                zygote.start()
            else:
                log.warning("--workers %d needs the pyfuse3 shim, which is not in effect: "
                            "serving from this one process", cfg.workers)
        trio.run(_serve, cfg, cache, catalog, ops, states, zygote, on_ready, indexing_sources,
                 session)
    finally:
        sd_notify("STOPPING=1")
        # A --fuse-fd mount is its maker's to unmount; a handed-over one the next daemon's.
        fuse_session.close(unmount=not session.leave_mounted)
        if cfg.fuse_fd is not None and session.keeper and not session.leave_mounted:
            _unmount_taken_over(cfg.mountpoint)
        if cfg.fuse_fd is None and not session.leave_mounted:  # nothing left to take over
            remove_record(cfg.cache_dir)
        if zygote is not None:
            zygote.stop()
        if session.leave_mounted:
            log.info("left %s mounted for the next daemon", cfg.mountpoint)
        else:
            log.info("unmounted %s", cfg.mountpoint)


def _push_would_block_a_restart() -> bool:
    """Under systemd's fd store, page push is off: the pusher's lookup process looks files up
    through the mount, and when the daemon is killed while such a lookup waits, that process
    cannot finish dying until a new daemon answers it, while systemd starts the new one only
    once every process of the unit is gone (a hang). The holder of a plain mount starts the
    new daemon at once, so it has no such wait."""
    if keeper() != "systemd":
        return False
    log.info("page push is off: the connection is kept by systemd's fd store, and a daemon "
             "killed mid-push could not be replaced (systemd/README.md)")
    return True


def _mount_visible(cfg: MountConfig) -> bool:
    """Whether the mount is in this process's mount namespace: a --fuse-fd daemon (a CSI
    mounter's) may serve a mount made in another one."""
    return cfg.fuse_fd is None or listed_mount(cfg.mountpoint)


def _still_mounted(cfg: MountConfig) -> bool:
    """Whether the connection goes on (asked when a worker dies): the mount table, or for a
    mount this namespace does not see, the connection itself (POLLERR once it has ended)."""
    if cfg.fuse_fd is None:
        return is_mounted(cfg.mountpoint)
    listed, alive = listed_mount(cfg.mountpoint), fuse_session_alive()
    log.debug("connection check: %s listed %s, connection alive %s", cfg.mountpoint, listed,
              alive)
    return listed or alive


def _unmount_taken_over(mountpoint: str) -> None:
    """A stop of a daemon that took the mount over (under the holder or systemd): libfuse did
    not mount it here, so it does not unmount it either; do it, lazily (nothing may wait on a
    connection nobody serves)."""
    if is_mounted(mountpoint):
        result = unmount(mountpoint, lazy=True)
        if result.returncode != 0:
            log.warning("cannot unmount %s: %s", mountpoint, result.stderr.strip())


# How long a takeover tries to bind the sockets a lingering previous daemon still holds.
TAKEOVER_SOCKET_WAIT_S = 120.0
TAKEOVER_DELAY_ENV = "SHARDFS_TAKEOVER_DELAY_S"  # tests: a takeover that hangs this long


def _test_takeover_delay() -> None:
    """Tests only: a takeover that hangs before it touches the connection, as one stuck on a
    slow disk would (tests/test_gap.py)."""
    with contextlib.suppress(ValueError):
        delay = float(os.environ.get(TAKEOVER_DELAY_ENV, "0"))
        if delay > 0:
            log.warning("%s=%g: waiting before the takeover", TAKEOVER_DELAY_ENV, delay)
            time.sleep(delay)


def _take_over(ops: ShardFS, cfg: MountConfig, record: SessionRecord) -> bool:
    """Adopt the live connection `cfg.fuse_fd` as an initialised session, as the record says
    the first daemon's was, and have the kernel queue again the requests the previous daemon
    had read and not answered. True (reads need no OPEN: a takeover needs the shim)."""
    assert cfg.fuse_fd is not None
    # A request the previous daemon answered just before it died is queued again too; the
    # kernel refuses our second answer (ENOENT), which is expected: keep it out of the log.
    logging.getLogger("pyfuse3").addFilter(not_a_late_answer)
    reply = fuse_session.resume(ops, cfg.fuse_fd, record.init_request, fuse_options(cfg))
    try:
        resend_unanswered(shim.session_fd())
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            log.warning("this kernel has no FUSE_NOTIFY_RESEND (Linux < 6.9): reads the "
                        "previous daemon had taken fail with ECONNABORTED")
        else:
            raise
    log.info("took over the mount at %s (takeover %d; INIT recorded by pid %d, protocol "
             "7.%d, reply of %d bytes replayed)", cfg.mountpoint, record.takeovers + 1,
             record.pid, describe_init(record.init_request)["minor"], len(reply))
    return True


def _say_when_signatures_expire(urls: list[str], settings: SourceSettings) -> None:
    """Signed URLs expire: the log says when, and warns when it is less than a day away."""
    when = signatures_expire(urls, settings)
    if when is None:
        return
    left = when - time.time()
    stamp, renew = format_utc(when), renewal_advice(settings)
    if left <= 0:
        log.warning("the shards' signed URLs expired at %s: fetches will be refused (%s)",
                    stamp, renew)
    elif left < EXPIRES_SOON_S:
        log.warning("the shards' signed URLs expire at %s, in %s: reads of shards not "
                    "cached by then fail (%s before then)", stamp, format_duration(left),
                    renew)
    else:
        log.info("the shards' signed URLs are valid until %s (in %s)", stamp,
                 format_duration(left))


async def _open_catalog(cfg: MountConfig, cache: ShardCache, sources: Sources,
                        infos: list[ShardInfo] | None = None) -> Catalog:
    try:
        urls = [s.url for s in infos] if infos is not None \
            else await resolve_sources(cfg.specs, sources)
        progress = ProgressLine("indexing shards")
        catalog = await open_catalog(urls, sources, cache,
                                     progress=_indexing_progress(progress),
                                     parallel=cfg.index_parallel,
                                     warm=cfg.warm_while_indexing, infos=infos)
        progress.close()
    finally:
        await sources.aclose()
    _say_when_signatures_expire([s.url for s in catalog.shards], cfg.settings)
    report = catalog.tree.report
    if report.shadowed:
        log.warning("%d paths appear in more than one shard; the later shard wins",
                    report.shadowed)
    if report.conflicts:
        log.warning("%d files are also used as directories by other members; "
                    "shown as directories", report.conflicts)
    return catalog


async def _serve(cfg: MountConfig, cache: ShardCache, catalog: Catalog, ops: ShardFS,
                 states: ShardStates, zygote: Zygote | None,
                 on_ready: Callable[[str], None], indexing_sources: Sources,
                 session: SessionState) -> None:
    sources = Sources(cfg.settings, after=indexing_sources)
    try:
        if cfg.in_place != "off":  # before the reader: it takes linked shards as complete
            await trio.to_thread.run_sync(link_in_place, catalog, cache,
                                          cfg.in_place == "auto")
        await trio.to_thread.run_sync(cache.drop_old_links)  # those not linked again
        reader = Reader(catalog, cache, sources, cfg.policy, states=states)
        mounted = Mounted(cfg, catalog, cache, reader, sources, session=session,
                          shim=ops.no_open)
        mounted.lookahead = attach_lookahead(reader, cfg.lookahead)
        if cfg.push_pages and worth_pushing(ops.no_open, reader.fetched_bytes, cache.budget) \
                and _mount_visible(cfg) and not _push_would_block_a_restart():
            mounted.pusher = PagePusher(catalog.tree, cache, catalog.keys, cfg.mountpoint)
            reader.on_complete = mounted.pusher.shard_complete
        if zygote is None:
            ops.reader = reader
            ops.stats_json = mounted.snapshot_json
            ops.fast = FastReads(states, cache.shards_dir, catalog.keys)
            mounted.ops = ops
        await _serve_mounted(mounted, zygote, on_ready)
    finally:
        await sources.aclose()


async def _report_status(mounted: Mounted) -> None:
    """STATUS= for systemd, throughput samples and the snapshot the metrics thread reads."""
    while True:
        mounted.throughput.sample(mounted.reader.stats.bytes_served)
        mounted.link.sample(mounted.bytes_fetched())
        mounted.latest = mounted.snapshot()
        sd_notify(f"STATUS={mounted.status_line(mounted.latest)}")
        await trio.sleep(STATUS_INTERVAL if os.environ.get("NOTIFY_SOCKET") else 1.0)


async def _watchdog(interval_s: float) -> None:
    # This task runs on the loop that serves FUSE requests: if the loop hangs, pings stop.
    while True:
        sd_notify("WATCHDOG=1")
        await trio.sleep(interval_s)


def _watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


def _record_session(mounted: Mounted) -> None:
    """Write the session record (sessionrecord.py) once INIT is answered, so that a new
    daemon can take this mount over; without the shim there is no INIT request to record,
    and the mount behaves as before (said once)."""
    cfg = mounted.cfg
    request = shim.init_request()
    if not request:  # no shim: hand_over() says so where a keeper was waiting for it
        remove_record(cfg.cache_dir)
        return
    record = SessionRecord(mountpoint=cfg.mountpoint, init_request=request,
                           shards=mounted.catalog.shards,
                           fuse_options=sorted(fuse_options(cfg)),
                           takeovers=mounted.session.takeovers,
                           mounted_at=mounted.session.mounted_at,
                           libfuse=fuse_session.libfuse_version())
    try:
        write_record(cfg.cache_dir, record)
        mounted.session.can_take_over = True
    except OSError as exc:
        log.warning("cannot write the session record (%s): the mount cannot be taken over", exc)


async def _serve_mounted(mounted: Mounted, zygote: Zygote | None,
                         on_ready: Callable[[str], None]) -> None:
    cfg, catalog = mounted.cfg, mounted.catalog
    with trio.open_signal_receiver(*STOP_SIGNALS, HANDOVER_SIGNAL) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(mounted.reader.run)
            if mounted.pusher is not None:
                await nursery.start(mounted.pusher.run)
            async def start_server(serve: Callable[..., Awaitable[None]], *args: Any) -> None:
                # A takeover serves first and binds its sockets once the previous daemon has let
                # go of them (bind_when_free); a first mount has them before it says READY.
                if cfg.takeover:
                    nursery.start_soon(partial(serve, patient_s=TAKEOVER_SOCKET_WAIT_S), *args)
                else:
                    await nursery.start(serve, *args)

            await start_server(serve_control, cfg.control_socket, mounted.handle)
            if mounted.lookahead is not None:
                await start_server(partial(serve_announcements, allow_other=cfg.allow_other,
                                           shards_ahead=mounted.reader),
                                   cfg.lookahead_socket, mounted.lookahead, catalog.tree)
            if zygote is None:
                async def fuse_main() -> None:
                    await fuse_session.serve(cfg.max_tasks)
                    log.info("%s was unmounted (shardfs umount, fusermount3 -u or umount)",
                             cfg.mountpoint)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(fuse_main)
                if mounted.ops is not None and mounted.ops.fast is not None:
                    nursery.start_soon(mounted.keep_fast_reads)
                    if mounted.lookahead is not None and in_c_wanted(mounted.ops.fast.active):
                        nursery.start_soon(mounted.keep_arena_reads)
            else:
                pool = WorkerPool(zygote, cfg.workers, mounted.reader,
                                  worker_address(cfg.control_socket, os.getpid()),
                                  mounted.snapshot_json, lambda: _still_mounted(cfg))
                mounted.workers = pool

                async def workers_main(*, task_status: trio.TaskStatus[None]
                                       = trio.TASK_STATUS_IGNORED) -> None:
                    await pool.run(task_status=task_status)  # started: every worker serves
                    nursery.cancel_scope.cancel()  # returned: the mount went away

                await nursery.start(workers_main)
            if _mount_visible(cfg):  # else INIT was answered before the workers forked
                await _probe_ready(cfg.mountpoint)
            _record_session(mounted)
            if not cfg.takeover:  # a takeover's keeper has the connection already
                mounted.session.keeper = hand_over(
                    shim.session_fd() if mounted.session.can_take_over else -1,
                    recorded=mounted.session.can_take_over)
            else:
                if mounted.session.keeper == "systemd":  # stored again: the same connection
                    hand_over(shim.session_fd(), recorded=mounted.session.can_take_over)
            nursery.start_soon(_report_status, mounted)
            interval = _watchdog_interval()
            if interval:
                nursery.start_soon(_watchdog, interval)
            if cfg.metrics_listen:
                from shardfs.daemon.metrics import start_metrics_server

                start_metrics_server(cfg.metrics_listen, lambda: mounted.latest)
            summary = (f"{catalog.tree.count_files()} files from {len(catalog.shards)} shards "
                       f"mounted at {cfg.mountpoint}")
            log.info("ready: %s", summary)
            if catalog.skipped:
                log.warning("members not exposed (unsafe names, devices, links leaving the "
                            "tree, ...): %s", catalog.skipped)
            frozen = freeze_startup_objects()  # full collections: not through the catalog again
            log.debug("%d objects exempt from garbage collection", frozen)
            on_ready(summary)
            async for signum in signals:
                if signum == HANDOVER_SIGNAL:
                    if mounted.session.keeper is None:
                        log.warning("received SIGUSR1, but nothing keeps the connection for "
                                    "a new daemon: ignored (SIGTERM unmounts)")
                        continue
                    mounted.session.leave_mounted = True
                    mounted.reader.keep_partial = True  # the next daemon continues them
                    log.info("received SIGUSR1: exiting, leaving the mount to the next daemon")
                    break
                log.info("received %s: unmounting", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()
