"""Command line: `shardfs mount|umount|index|pack|demo`."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

from shardfs import __version__
from shardfs.cli.daemonize import READY_PREFIX
from shardfs.util.urls import redact

log = logging.getLogger("shardfs")


class UsageError(Exception):
    """Bad input from the user: printed as `shardfs: error: ...`, exit status 1."""


def default_cache_dir(mountpoint: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    tag = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:12]
    return Path(base) / "shardfs" / tag


def default_workers() -> int:
    """FUSE worker processes by default: half the cores this process may use (the other half
    is the training's: DataLoader workers), at least 1, at most 8. Each serving process reads
    its requests with a thread of C (docs/pyfuse3.md), so on 2 cores the daemon alone spends
    less CPU per cold file than 2 workers, for as many files/s (docs/benchmarks-notes.md, "A
    Lookahead epoch's first 100 ms, and one serving process on 2 cores")."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def default_cache_size(cache_dir: Path) -> int:
    """80 % of the free space where the cache lives (counting what it holds), at most 50 GiB."""
    probe = cache_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    held = sum(f.stat().st_size for f in (cache_dir / "shards").glob("*")) \
        if (cache_dir / "shards").is_dir() else 0
    return min(50 << 30, int((free + held) * 0.8))


def absolute_specs(specs: list[str]) -> list[str]:
    """Plain paths made absolute here, where the user's working directory is known (the
    daemon resolves SOURCEs later, after it has detached)."""
    return [s if "://" in s else os.path.abspath(s) for s in specs]


# -- mount ---------------------------------------------------------------------------------
# Flags that map 1:1 onto config keys; their argparse default is None ("not given") so that
# a config file or -o option is only overridden by flags the user really typed.
_FLAG_KEYS = ("cache_dir", "cache_size", "timeout", "deadline", "max_fetches",
              "max_member_fetches", "cold_start", "prefetch", "push_pages", "split_fetches",
              "small_windows", "in_place",
              "index_parallel", "workers", "verify",
              "log_level", "log_file", "metrics_listen", "uid", "gid",
              "s3_endpoint", "s3_region", "s3_profile", "s3_addressing", "ais_endpoint",
              "hf_endpoint", "gs_endpoint", "request_rate", "http_client", "lookahead_buffer",
              "lookahead_fill")


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("positional", nargs="*", metavar="SOURCE... MOUNTPOINT",
                   help="shards: http(s)://, s3://, gs://, hf://, ais://, file:// URLs or "
                   "paths; brace patterns expand; a bucket prefix, directory or manifest "
                   "(.txt, wids .json) "
                   "names all its shards. Then the mountpoint. With --config, both may come "
                   "from the file.")
    p.add_argument("--config", metavar="FILE", help="YAML settings (flags override it)")
    p.add_argument("-o", dest="options", metavar="OPT[,OPT=VAL...]", action="append",
                   help="mount-style options, e.g. cache_dir=/var/cache/x,cache_size=50G")
    p.add_argument("--cache-dir", help="where shard data and indexes are cached "
                   "(default: ~/.cache/shardfs/<hash of the mountpoint>)")
    p.add_argument("--cache-size", help="cache budget, e.g. 50G or 500MiB "
                   "(default: 80%% of free space there, at most 50 GiB)")
    p.add_argument("-f", "--foreground", action="store_true",
                   help="stay in the foreground; unmount on SIGINT/SIGTERM")
    p.add_argument("--timeout", help="seconds a single request may stall (default 10)")
    p.add_argument("--deadline",
                   help="seconds without progress before a read fails with EIO (default 60)")
    p.add_argument("--max-fetches", help="whole-shard downloads at once (default 8)")
    p.add_argument("--max-member-fetches", help="single-member (or block) requests at once, "
                   "for reads that do not wait for a whole shard (default 32)")
    p.add_argument("--cold-start", metavar="SECONDS",
                   help="for this long from the first read of an uncached shard, at most 2 "
                   "whole-shard downloads (of shards of 8 MiB or more) run, so that the first "
                   "reads' own requests have the link (default 1; 0: off)")
    p.add_argument("--prefetch", choices=("touched", "all"),
                   help="fetch shards once read (touched, default) or warm all that fit (all)")
    p.add_argument("--push-pages", choices=("auto", "off"),
                   help="put each fetched shard's files into the kernel's page cache when the "
                   "dataset fits the cache and a quarter of RAM (auto, default) or never (off)")
    p.add_argument("--verify", choices=("auto", "sha256"),
                   help="check each complete download against its index's CRC-32C where it "
                   "has one, else its sha256 (auto, default), or its sha256 where it has one "
                   "(sha256: ten times the CPU)")
    p.add_argument("--small-windows", choices=("on", "off"),
                   help="the cold start's downloads get small TCP receive windows where a "
                   "queue is seen on the way, so the first reads' replies do not wait behind "
                   "their bytes (on, default), or keep the kernel's autotuned windows (off)")
    p.add_argument("--split-fetches", choices=("on", "off"),
                   help="a read far ahead of a whole-shard download gets its file by a request "
                   "of its own, which the download then skips (on; the download's bytes already in "
                   "flight past that point are wasted), or reads it alongside, fetching it "
                   "twice, within 10%% of the bytes (off, default)")
    p.add_argument("--in-place", choices=("on", "off", "auto"),
                   help="read plain shards named by file:// URLs where they are, from their "
                   "own files, instead of copying them into the cache (auto, default: "
                   "those on a local file system; on: all of them; off: none, every shard "
                   "copied, as suits a network file system)")
    p.add_argument("--index-parallel", help="shards indexed at once (default 8)")
    p.add_argument("--workers", help="processes answering FUSE requests (default: half the "
                   "machine's cores, 1 to 8; 1: the daemon alone)")
    p.add_argument("--lookahead-buffer", help="RAM for files announced by "
                   "shardfs.torch.Lookahead, fetched and not yet read (default 64MiB; 0: off)")
    p.add_argument("--lookahead-fill", choices=("on", "off"),
                   help="when the dataset fits the cache, fetch the files Lookahead announces "
                   "in its order into their shards' cache files, every byte once (on, "
                   "default), or only the epoch's first 32 and the rest as whole shards (off: "
                   "less CPU per file)")
    p.add_argument("--no-warm", action="store_true",
                   help="do not keep the bytes streamed for indexing in the cache")
    p.add_argument("--nonempty", action="store_true",
                   help="mount over a directory that has files in it (hiding them while "
                   "mounted); refused otherwise")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users access the mount (needs user_allow_other)")
    p.add_argument("--uid", help="owner shown for all files (default: the daemon's uid)")
    p.add_argument("--gid", help="group shown for all files (default: the daemon's gid)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="how much the daemon logs (default info; debug adds every request)")
    p.add_argument("--log-file", help="log here once daemonized "
                   "(default: shardfs.log in the cache dir)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics here (needs prometheus-client)")
    p.add_argument("--s3-endpoint", help="S3-compatible endpoint for s3:// sources "
                   "(default: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the AWS config, AWS)")
    p.add_argument("--s3-region", help="region for s3:// (default: $AWS_REGION, AWS config)")
    p.add_argument("--s3-profile", help="profile in ~/.aws/credentials and ~/.aws/config")
    p.add_argument("--s3-addressing", choices=("auto", "path", "virtual"),
                   help="bucket in the path or the host name (auto: path on custom endpoints)")
    p.add_argument("--ais-endpoint", help="AIStore gateway for ais:// (default: $AIS_ENDPOINT)")
    p.add_argument("--hf-endpoint", help="Hugging Face Hub for hf:// (default: $HF_ENDPOINT, "
                   "https://huggingface.co)")
    p.add_argument("--gs-endpoint", help="GCS XML API for gs:// (default: "
                   "$STORAGE_EMULATOR_HOST, https://storage.googleapis.com)")
    p.add_argument("--request-rate", metavar="N",
                   help="at most N requests/s to the sources (default: unlimited until a "
                   "store throttles, then adaptive)")
    p.add_argument("--http-client", choices=("auto", "httpx"),
                   help="GETs over shardfs's own HTTP/1.1 connections, proxies and unusual answers "
                   "through httpx (auto, default), or everything through httpx (httpx)")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    add_takeover_arguments(p)


# -- mounts that outlive their daemon (issue 25): --fuse-fd, --takeover, restart ------------
def add_takeover_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fuse-fd", type=int, metavar="N",
                   help="serve the open /dev/fuse descriptor N, which another process has "
                   "already mounted at MOUNTPOINT (mount -t fuse.shardfs -o fd=N,...); that "
                   "process unmounts it")
    p.add_argument("--takeover", action="store_true",
                   help="with --fuse-fd: the connection was served by an earlier shardfs "
                   "daemon using the same cache dir (its INIT is answered); take it over "
                   "from that daemon's session record, serving again the requests it left")
    p.add_argument("--no-holder", action="store_true",
                   help="do not leave a holder process behind: the mount ends with the daemon")
    p.add_argument("--standby-fd", type=int, help=argparse.SUPPRESS)  # the holder's spare


FUSE_DEVICE = os.makedev(10, 229)  # /dev/fuse
TAKEOVER_LOCK_WAIT_S = 10.0  # a daemon being replaced may still be letting go of the cache


def check_fuse_fd(args: argparse.Namespace) -> None:
    """--fuse-fd must name an open /dev/fuse descriptor; --takeover needs one."""
    if args.fuse_fd is None:
        if args.takeover:
            raise UsageError("--takeover needs --fuse-fd N (the live connection to take over)")
        return
    import stat

    try:
        st = os.fstat(args.fuse_fd)
    except OSError:
        raise UsageError(f"--fuse-fd {args.fuse_fd}: no such open descriptor") from None
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != FUSE_DEVICE:
        raise UsageError(f"--fuse-fd {args.fuse_fd} is not a /dev/fuse descriptor")
    os.set_inheritable(args.fuse_fd, False)


def holder_plan(args: argparse.Namespace) -> tuple[str, str, str] | None:
    """(mountpoint, log path, deadline in seconds) for a holder process to keep the mount's
    connection (and to fail reads with EIO once a gap without a daemon outlasts the mount's
    --deadline), or None:
    --no-holder, --fuse-fd (whoever passed it keeps it), or settings the daemon will reject
    with its own message."""
    if args.no_holder or args.fuse_fd is not None:
        return None
    from shardfs.cli.config import ConfigError

    try:
        settings = mount_settings(args)
    except (UsageError, ConfigError):
        return None
    mountpoint = os.path.abspath(settings["mountpoint"])
    cache_dir = Path(settings["cache_dir"]) if settings["cache_dir"] \
        else default_cache_dir(mountpoint)
    log_path = settings["log_file"] or str(cache_dir.resolve() / "shardfs.log")
    return mountpoint, os.path.abspath(log_path), repr(settings["deadline"])


def adopt_systemd_descriptor(args: argparse.Namespace) -> None:
    """Started by systemd with the connection from its fd store (LISTEN_FDS): take over."""
    if args.fuse_fd is not None:
        return
    from shardfs.daemon.handover import descriptor_from_systemd

    fd = descriptor_from_systemd()
    if fd is not None:
        args.fuse_fd, args.takeover = fd, True
        log.info("systemd handed back the FUSE connection (fd %d): taking the mount over", fd)


def wait_as_standby(args: argparse.Namespace) -> bool:
    """The holder's spare daemon: everything is imported; wait until the holder says "go"
    (the daemon died, or a restart). False: the holder let us go instead. "go ask" keeps the
    standby pipe open for `ask_holder_to_let_go`."""
    from shardfs.cli.daemonize import GO_ASKING_LINE, STANDBY_LINE

    args.ask_before_takeover = False
    if args.standby_fd is None:
        return True
    if args.ready_fd is not None:
        os.write(args.ready_fd, STANDBY_LINE.encode())
    word = _read_line(args.standby_fd)
    if word == GO_ASKING_LINE:
        args.ask_before_takeover = True
        return True
    os.close(args.standby_fd)
    return word == b"go\n"


def _read_line(fd: int, limit: int = 64) -> bytes:
    """Bytes up to and including a newline (b"" at end of file), one at a time: nothing past
    the line is taken off the pipe."""
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        line += chunk
    return line


def ask_holder_to_let_go(args: argparse.Namespace) -> None:
    """Just before a spare touches the connection: the holder stops answering requests with
    EIO (once the gap outlasted --deadline it does) and says so; from then on only this daemon
    reads the connection. A holder that is gone has nothing to stop."""
    from shardfs.cli.daemonize import LET_GO_LINE, TAKING_OVER_LINE

    if not getattr(args, "ask_before_takeover", False):
        return
    args.ask_before_takeover = False
    try:
        os.write(args.ready_fd, TAKING_OVER_LINE.encode())
        answer = _read_line(args.standby_fd)
    except OSError:
        answer = b""
    finally:
        os.close(args.standby_fd)
    if answer != LET_GO_LINE:
        log.warning("the holder did not answer before the takeover (%r): going on", answer)


def open_cache_for_takeover(cache) -> None:
    """The daemon being replaced may still hold the cache dir for a moment: wait for it."""
    import time

    from shardfs.cache.shardcache import CacheError

    deadline = time.monotonic() + TAKEOVER_LOCK_WAIT_S
    while True:
        try:
            cache.open()
            return
        except CacheError as exc:
            if "in use" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
def add_restart_parser(sub) -> None:
    restart = sub.add_parser("restart", help="replace a mount's daemon (the code installed "
                             "now) under the live mount, with no read error")
    restart.add_argument("mountpoint", metavar="MOUNTPOINT", help="a running shardfs mount")
    restart.add_argument("--timeout", type=float, default=120.0,
                         help="seconds to wait for the new daemon (default 120)")


def run_restart(args: argparse.Namespace) -> int:
    """Ask the mount's holder for a new daemon; return once it serves."""
    import json
    import signal
    import time

    def stats() -> dict:
        return json.loads(os.getxattr(args.mountpoint, "user.shardfs.stats"))

    try:
        before = stats()
    except OSError as exc:
        print(f"shardfs: error: {args.mountpoint} is not a running shardfs mount "
              f"({exc.strerror})", file=sys.stderr)
        return 1
    holder = before.get("holder_pid")
    if not holder:
        kept = before.get("connection_kept_by")
        hint = ("it runs under systemd: systemctl restart its unit" if kept == "systemd" else
                "it was mounted with --no-holder or --fuse-fd, or cannot be taken over "
                "(see its log)")
        print(f"shardfs: error: no holder keeps {args.mountpoint}: {hint}", file=sys.stderr)
        return 1
    os.kill(holder, signal.SIGUSR1)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        with contextlib.suppress(OSError, ValueError):
            now = stats()
            if now["pid"] != before["pid"]:
                print(f"shardfs: restarted {args.mountpoint}: daemon pid {before['pid']} -> "
                      f"{now['pid']} (takeover {now['takeovers']})")
                return 0
    print(f"shardfs: error: no new daemon serves {args.mountpoint} after {args.timeout:.0f} s "
          "(see its log)", file=sys.stderr)
    return 1
# -- end of issue 25's block ---------------------------------------------------------------


def _looks_like_source(text: str) -> bool:
    """A URL, a brace pattern or an existing file: what a lone argument names when the user
    forgot the MOUNTPOINT (a mountpoint is a directory)."""
    if "://" in text or "{" in text or os.path.isfile(text):
        return True
    return os.path.isdir(text) and any(Path(text).glob("*.tar*"))


def mount_settings(args: argparse.Namespace) -> dict:
    """Merge defaults, --config / -o config=, -o options and flags (in that order)."""
    from shardfs.cli.config import load_file, merge, parse_mount_options, validate

    option_layer: dict = {}
    config_file = args.config
    for text in args.options or []:
        layer, named = parse_mount_options(text)
        option_layer.update(layer)
        config_file = config_file or named
    file_layer = load_file(config_file) if config_file else {}
    flags = {key: getattr(args, key) for key in _FLAG_KEYS}
    if args.no_warm:
        flags["warm_while_indexing"] = False
    if args.allow_other:
        flags["allow_other"] = True
    if args.nonempty:
        flags["nonempty"] = True
    positional = list(args.positional)
    if len(positional) >= 2:
        flags["sources"], flags["mountpoint"] = positional[:-1], positional[-1]
    elif len(positional) == 1:
        flags["mountpoint"] = positional[0]
    flag_layer = validate({k: v for k, v in flags.items() if v is not None}, "command line")
    settings = merge(file_layer, option_layer, flag_layer)
    if not settings["mountpoint"]:
        raise UsageError("no MOUNTPOINT given (on the command line or as 'mountpoint' in the "
                         "config file)")
    if not settings["sources"] and len(positional) == 1 and _looks_like_source(positional[0]):
        raise UsageError(f"no MOUNTPOINT given: {positional[0]!r} is taken as a SOURCE; "
                         "usage: shardfs mount SOURCE... MOUNTPOINT")
    if not settings["sources"]:
        raise UsageError("no SOURCE given (on the command line or as 'sources' in the config "
                         "file)")
    return settings


def _mount_config(s: dict):
    from shardfs.cli.config import source_secrets
    from shardfs.daemon.lifecycle import MountConfig
    from shardfs.read.lookahead import LookaheadPolicy
    from shardfs.read.reader import ReadPolicy
    from shardfs.sources import SourceSettings

    mountpoint = s["mountpoint"]
    cache_dir = Path(s["cache_dir"]) if s["cache_dir"] else default_cache_dir(mountpoint)
    cache_size = s["cache_size"] or default_cache_size(cache_dir)
    return MountConfig(
        specs=absolute_specs(s["sources"]), mountpoint=os.path.abspath(mountpoint),
        cache_dir=cache_dir.resolve(), cache_size=cache_size,
        settings=SourceSettings(
            timeout=s["timeout"], deadline=s["deadline"], s3_endpoint=s["s3_endpoint"],
            s3_region=s["s3_region"], s3_profile=s["s3_profile"],
            s3_addressing=s["s3_addressing"], ais_endpoint=s["ais_endpoint"],
            hf_endpoint=s["hf_endpoint"], gs_endpoint=s["gs_endpoint"],
            request_rate=s["request_rate"], http_client=s["http_client"],
            **source_secrets(s["credentials"])),
        policy=ReadPolicy(max_fetches=s["max_fetches"],
                          max_member_fetches=s["max_member_fetches"], prefetch=s["prefetch"],
                          cold_start_s=s["cold_start"],
                          split_fetches=s["split_fetches"], verify=s["verify"],
                          cold_start_small_windows=s["small_windows"]),
        lookahead=LookaheadPolicy(buffer_bytes=s["lookahead_buffer"],
                                  max_requests=s["lookahead_requests"],
                                  fill_parts=s["lookahead_fill"]),
        index_parallel=s["index_parallel"], warm_while_indexing=s["warm_while_indexing"],
        in_place=s["in_place"], push_pages=s["push_pages"] == "auto",
        workers=s["workers"] or default_workers(),
        allow_other=s["allow_other"],
        uid=os.getuid() if s["uid"] is None else s["uid"],
        gid=os.getgid() if s["gid"] is None else s["gid"],
        log_level=s["log_level"], log_file=s["log_file"], metrics_listen=s["metrics_listen"])


def run_mount_foreground(args: argparse.Namespace) -> int:

    from shardfs.cache.shardcache import CacheError, ShardCache
    from shardfs.catalog.catalog import CatalogError
    from shardfs.cli.config import ConfigError
    from shardfs.cli.foreground import check_cache_budget, remove_if_unused
    from shardfs.cli.logsetup import MountLog
    from shardfs.daemon.lifecycle import Interrupted
    from shardfs.daemon.lifecycle import run as run_daemon
    from shardfs.daemon.mountpoint import MountpointError, prepare_mountpoint
    from shardfs.daemon.notify import sd_notify
    from shardfs.daemon.sessionrecord import RecordError
    from shardfs.sources import SourceError
    from shardfs.util.aioutil import first_error
    from shardfs.util.progress import end_lines

    daemonized = args.ready_fd is not None
    mount_log = MountLog(args.log_level or "info")
    created_cache_dir: Path | None = None
    cache: ShardCache | None = None
    # Until trio's own signal receiver takes over, a stop signal ends the set-up cleanly.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop_setup)
    try:
        settings = mount_settings(args)
        cfg = _mount_config(settings)
        cfg.detached = daemonized
        mount_log.set_level(cfg.log_level)
        if not wait_as_standby(args):
            return 0
        adopt_systemd_descriptor(args)
        check_fuse_fd(args)
        cfg.fuse_fd, cfg.takeover = args.fuse_fd, args.takeover
        cfg.before_takeover = lambda: ask_holder_to_let_go(args)
        if cfg.fuse_fd is None:  # else the descriptor's maker mounted it there
            cfg.mountpoint = prepare_mountpoint(cfg.mountpoint, nonempty=settings["nonempty"])
        if not cfg.cache_dir.exists():
            created_cache_dir = cfg.cache_dir
        cache = ShardCache(cfg.cache_dir, cfg.cache_size)
        if cfg.takeover:
            open_cache_for_takeover(cache)
        else:
            cache.open()
        log_file = cfg.log_path
        if daemonized and args.standby_fd is None:  # a spare's stderr is the log already
            # Mount-time lines go to the waiting terminal and to the log the daemon keeps.
            try:
                mount_log.add_file(log_file)
            except OSError as exc:
                raise UsageError(f"cannot write the log file {log_file}: {exc.strerror}") \
                    from None
        check_cache_budget(cfg.cache_dir, cfg.cache_size)
    except (UsageError, ConfigError, MountpointError, CacheError, KeyboardInterrupt) as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        if not (interrupted and daemonized):
            print("shardfs: interrupted" if interrupted else
                  f"shardfs: error: {redact(str(exc))}", file=sys.stderr)
        if cache is not None:
            cache.close()
        if created_cache_dir is not None:
            remove_if_unused(created_cache_dir)
        return 130 if interrupted else 1

    def on_ready(summary: str) -> None:
        sd_notify("READY=1", f"STATUS={summary}")
        if daemonized:
            # Detach from the caller's terminal before telling it we are ready.
            mount_log.detach_terminal()
            fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.write(args.ready_fd, (READY_PREFIX + summary + "\n").encode())
            os.close(args.ready_fd)

    code = 1
    try:
        with first_error():
            run_daemon(cfg, cache, on_ready)
        code = 0
    except (CatalogError, SourceError, RecordError) as exc:
        _say_error(str(exc))
    except (KeyboardInterrupt, Interrupted) as exc:
        end_lines()
        if daemonized:  # the waiting parent says it on the terminal, once
            mount_log.detach_terminal()
        else:
            print("shardfs: interrupted", file=sys.stderr)
        log.info("stopped by %s before the mount was ready", exc or "SIGINT")
        code = 130
    except RuntimeError as exc:  # pyfuse3.init failures (e.g. /dev/fuse missing)
        _say_error(f"cannot mount {cfg.mountpoint}: {exc}")
    except OSError as exc:  # local trouble (disk, permissions): a message, not a traceback
        _say_error(str(exc))
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):  # trio gave them back: finish first
            signal.signal(signum, signal.SIG_IGN)
        cache.close()
        if code != 0 and created_cache_dir is not None:
            mount_log.close_file()
            remove_if_unused(created_cache_dir)
    return code


def _stop_setup(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _say_error(message: str) -> None:
    from shardfs.util.progress import end_lines

    end_lines()  # after a progress line drawn on the terminal, not glued to its end
    print(f"shardfs: error: {redact(message)}", file=sys.stderr)  # no signed URL's token


def run_mount_daemon(argv: list[str], args: argparse.Namespace) -> int:
    """Start the daemon as a detached child; return once the mount is ready (or failed)."""
    from shardfs.cli.daemonize import run_daemon

    return run_daemon(argv, holder=holder_plan(args))


# -- other commands ------------------------------------------------------------------------
def run_umount(args: argparse.Namespace) -> int:
    from shardfs.daemon.mountpoint import MountpointError, unmount_shardfs

    try:
        unmount_shardfs(args.mountpoint, lazy=args.lazy)
    except MountpointError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_index(args: argparse.Namespace) -> int:
    from shardfs.cli.indexcmd import write_indexes
    from shardfs.cli.logsetup import setup_logging

    setup_logging(args.log_level)
    return write_indexes(absolute_specs(args.sources), Path(args.output),
                         parallel=args.parallel)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardfs",
        description="Mount remote tar shards (WebDataset) as a read-only directory tree.")
    parser.add_argument("--version", action="version", version=f"shardfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mount = sub.add_parser("mount", help="mount shards at a directory")
    add_mount_arguments(mount)

    umount = sub.add_parser("umount", help="unmount a shardfs mount")
    umount.add_argument("mountpoint", metavar="MOUNTPOINT",
                        help="where a shardfs mount is (anything else is refused)")
    umount.add_argument("-z", "--lazy", action="store_true",
                        help="detach now even if busy; the daemon exits once the last file "
                        "in the mount is closed")

    index = sub.add_parser("index", help="write index files to publish next to the shards")
    index.add_argument("sources", nargs="+", metavar="SOURCE",
                       help="shards, as for mount: URLs, paths, brace patterns, manifests")
    index.add_argument("-o", "--output", required=True, metavar="DIR",
                       help="write <shard name>.shardfs.idx here, one per shard, to upload "
                       "next to the shards")
    index.add_argument("--parallel", type=int, default=8,
                       help="shards indexed at once (default 8)")
    index.add_argument("--log-level", default="info",
                       choices=("debug", "info", "warning", "error"),
                       help="how much to log (default info)")

    pack = sub.add_parser("pack", help="turn a directory tree into WebDataset tar shards")
    from shardfs.pack import configure_pack_parser
    configure_pack_parser(pack)

    stats = sub.add_parser("stats", help="show a running mount's counters")
    stats.add_argument("mountpoint", metavar="MOUNTPOINT", help="a running shardfs mount")
    stats.add_argument("--json", action="store_true", help="print the raw JSON snapshot")

    warm = sub.add_parser("warm", help="fetch shards into the cache ahead of reading")
    warm.add_argument("paths", nargs="+", metavar="PATH",
                      help="the mountpoint (everything), or files/directories under one mount")
    warm.add_argument("--no-wait", action="store_true",
                      help="queue the fetches and return without a progress bar")

    add_restart_parser(sub)

    demo = sub.add_parser("demo", help="run a small end-to-end demo on loopback")
    demo.add_argument("--workdir", help="keep the demo's files here (default: a temp dir)")

    # -- Kubernetes CSI driver (docs/kubernetes.md); grpcio only needed when run ------------
    csi = sub.add_parser("csi", help="Kubernetes CSI node plugin (privileged)")
    from shardfs.csi.plugin.args import add_arguments as add_csi_arguments
    add_csi_arguments(csi)
    csi_mounter = sub.add_parser("csi-mounter",
                                 help="Kubernetes: serve the CSI plugin's mounts (unprivileged)")
    from shardfs.csi.mounter.args import add_arguments as add_mounter_arguments
    add_mounter_arguments(csi_mounter)
    _add_observe_commands(sub)
    return parser


# -- top, doctor: seeing what a mount does (shardfs/cli/top.py, shardfs/cli/doctor.py) ------
OBSERVE_COMMANDS = ("top", "doctor")


def _add_observe_commands(sub: argparse._SubParsersAction) -> None:
    from shardfs.cli.doctor import configure_doctor_parser
    from shardfs.cli.top import configure_top_parser

    configure_top_parser(sub.add_parser(
        "top", help="live view of mounts: files/s, MiB/s, fetches, waits, cache, CPU"))
    configure_doctor_parser(sub.add_parser(
        "doctor", help="check this machine, a mount or SOURCEs: what blocks or slows mounting"))


def _run_observe_command(args: argparse.Namespace) -> int:
    if args.command == "top":
        from shardfs.cli.top import run_top
        return run_top(args)
    from shardfs.cli.doctor import run_doctor
    return run_doctor(args)


COMMANDS = ("mount", "umount", "index", "pack", "stats", "warm", "demo", "restart", "csi",
            "csi-mounter", *OBSERVE_COMMANDS)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        # mount(8) via mount.fuse3 runs `shardfs SOURCE MOUNTPOINT -o OPTIONS`.
        argv = ["mount", *argv]
    args = build_parser().parse_args(argv)
    if args.command == "mount":
        code = run_mount_foreground(args) if args.foreground else run_mount_daemon(argv, args)
    elif args.command == "umount":
        code = run_umount(args)
    elif args.command == "index":
        code = run_index(args)
    elif args.command == "pack":
        from shardfs.pack import run_pack
        code = run_pack(args)
    elif args.command == "stats":
        from shardfs.daemon.control import run_stats
        code = run_stats(args)
    elif args.command == "warm":
        from shardfs.daemon.control import run_warm
        code = run_warm(args)
    elif args.command == "restart":
        code = run_restart(args)
    elif args.command == "demo":
        from shardfs.cli.demo import run_demo
        code = run_demo(args)
    elif args.command == "csi":
        from shardfs.csi.plugin.args import run_command as run_csi_plugin
        code = run_csi_plugin(args)
    elif args.command == "csi-mounter":
        from shardfs.csi.mounter.server import run as run_csi_mounter
        code = run_csi_mounter(args)
    elif args.command in OBSERVE_COMMANDS:
        code = _run_observe_command(args)
    else:  # pragma: no cover - argparse enforces the choices
        code = 2
    sys.exit(code)
