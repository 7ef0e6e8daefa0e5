"""Command line: `shardfs mount|umount|index|pack|demo`."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from shardfs import __version__

log = logging.getLogger("shardfs")
READY_PREFIX = "READY "


class UsageError(Exception):
    """Bad input from the user: printed as `shardfs: error: ...`, exit status 1."""


def _setup_logging(level: str, log_file: str | None = None) -> None:
    handler: logging.Handler
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    # journald adds its own timestamps; a terminal or file wants them.
    under_journal = "JOURNAL_STREAM" in os.environ and not log_file
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journal else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def default_cache_dir(mountpoint: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    tag = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:12]
    return Path(base) / "shardfs" / tag


def default_cache_size(cache_dir: Path) -> int:
    """80 % of the free space where the cache lives (counting what it holds), at most 50 GiB."""
    probe = cache_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    held = sum(f.stat().st_size for f in (cache_dir / "shards").glob("*")) \
        if (cache_dir / "shards").is_dir() else 0
    return min(50 << 30, int((free + held) * 0.8))


def expand_sources(specs: list[str]) -> list[str]:
    from shardfs.patterns import PatternError, expand_braces
    from shardfs.sources import to_url

    urls: list[str] = []
    for spec in specs:
        try:
            names = expand_braces(spec)
        except PatternError as exc:
            raise UsageError(str(exc)) from None
        urls.extend(to_url(name) for name in names)
    if not urls:
        raise UsageError("no shards: the SOURCE patterns expand to nothing")
    return urls


# -- mount ---------------------------------------------------------------------------------
def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="shard URL (http://, https://, file://) or path; brace patterns expand")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--cache-dir", help="where shard data and indexes are cached "
                   "(default: ~/.cache/shardfs/<hash of the mountpoint>)")
    p.add_argument("--cache-size", help="cache budget, e.g. 50G or 500MiB "
                   "(default: 80%% of free space there, at most 50 GiB)")
    p.add_argument("-f", "--foreground", action="store_true",
                   help="stay in the foreground; unmount on SIGINT/SIGTERM")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds a single request may stall (default 10)")
    p.add_argument("--deadline", type=float, default=60.0,
                   help="seconds without progress before a read fails with EIO (default 60)")
    p.add_argument("--max-fetches", type=int, default=4,
                   help="whole-shard downloads at once (default 4)")
    p.add_argument("--prefetch", choices=("touched", "all"), default="touched",
                   help="fetch shards once read (touched) or warm all that fit (all)")
    p.add_argument("--index-parallel", type=int, default=8,
                   help="shards indexed at once when no index exists yet (default 8)")
    p.add_argument("--no-warm", action="store_true",
                   help="do not keep the bytes streamed for indexing in the cache")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users access the mount (needs user_allow_other)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-file", help="log here once daemonized "
                   "(default: shardfs.log in the cache dir)")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _mount_config(args: argparse.Namespace):
    from shardfs.daemon import MountConfig
    from shardfs.reader import ReadPolicy
    from shardfs.sizes import parse_size
    from shardfs.sources import SourceSettings

    urls = expand_sources(args.sources)
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir(args.mountpoint)
    try:
        cache_size = parse_size(args.cache_size) if args.cache_size else \
            default_cache_size(cache_dir)
    except ValueError as exc:
        raise UsageError(f"--cache-size: {exc}") from None
    if args.deadline <= 0 or args.timeout <= 0 or args.max_fetches < 1:
        raise UsageError("--timeout and --deadline must be > 0, --max-fetches >= 1")
    return MountConfig(
        urls=urls, mountpoint=os.path.abspath(args.mountpoint), cache_dir=cache_dir.resolve(),
        cache_size=cache_size,
        settings=SourceSettings(timeout=args.timeout, deadline=args.deadline),
        policy=ReadPolicy(max_fetches=args.max_fetches, prefetch=args.prefetch),
        index_parallel=args.index_parallel, warm_while_indexing=not args.no_warm,
        allow_other=args.allow_other)


def run_mount_foreground(args: argparse.Namespace) -> int:
    import trio

    from shardfs.aioutil import first_error
    from shardfs.cache import CacheError, ShardCache
    from shardfs.catalog import CatalogError
    from shardfs.daemon import serve
    from shardfs.mountpoint import MountpointError, prepare_mountpoint
    from shardfs.notify import sd_notify
    from shardfs.sources import SourceError

    _setup_logging(args.log_level)
    ready_fd = args.ready_fd
    try:
        cfg = _mount_config(args)
        cfg.mountpoint = prepare_mountpoint(cfg.mountpoint)
        cache = ShardCache(cfg.cache_dir, cfg.cache_size)
        cache.open()
    except (UsageError, MountpointError, CacheError) as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1

    def on_ready(summary: str) -> None:
        sd_notify("READY=1", f"STATUS={summary}")
        if ready_fd is not None:
            # Detach from the caller's terminal before telling it we are ready.
            log_file = args.log_file or str(cfg.cache_dir / "shardfs.log")
            _setup_logging(args.log_level, log_file)
            fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.write(ready_fd, (READY_PREFIX + summary + "\n").encode())
            os.close(ready_fd)

    try:
        with first_error():
            trio.run(serve, cfg, cache, on_ready)
    except (CatalogError, SourceError) as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardfs: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # pyfuse3.init failures (e.g. /dev/fuse missing)
        print(f"shardfs: error: cannot mount {cfg.mountpoint}: {exc}", file=sys.stderr)
        return 1
    finally:
        cache.close()
    return 0


def run_mount_daemon(argv: list[str]) -> int:
    """Start the daemon as a detached child; return once the mount is ready (or failed)."""
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "shardfs", *argv, "--foreground", "--ready-fd", str(write_fd)]
    child = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                             start_new_session=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        message = ready.read().decode(errors="replace")
    if message.startswith(READY_PREFIX):
        print(f"shardfs: {message[len(READY_PREFIX):].strip()} (daemon pid {child.pid})")
        return 0
    code = child.wait()
    return code or 1


# -- other commands ------------------------------------------------------------------------
def run_umount(args: argparse.Namespace) -> int:
    from shardfs.mountpoint import MountpointError, unmount

    try:
        result = unmount(os.path.abspath(args.mountpoint), lazy=args.lazy)
    except MountpointError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    if result.returncode != 0:
        print(f"shardfs: error: {result.stderr.strip()}", file=sys.stderr)
        return 1
    return 0


def run_index(args: argparse.Namespace) -> int:
    from shardfs.indexcmd import write_indexes

    _setup_logging(args.log_level)
    try:
        urls = expand_sources(args.sources)
        return write_indexes(urls, Path(args.output), parallel=args.parallel)
    except UsageError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardfs",
        description="Mount remote tar shards (WebDataset) as a read-only directory tree.")
    parser.add_argument("--version", action="version", version=f"shardfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mount = sub.add_parser("mount", help="mount shards at a directory")
    add_mount_arguments(mount)

    umount = sub.add_parser("umount", help="unmount a shardfs mount")
    umount.add_argument("mountpoint", metavar="MOUNTPOINT")
    umount.add_argument("-z", "--lazy", action="store_true", help="detach even if busy")

    index = sub.add_parser("index", help="write index files to publish next to the shards")
    index.add_argument("sources", nargs="+", metavar="SOURCE")
    index.add_argument("-o", "--output", required=True, metavar="DIR")
    index.add_argument("--parallel", type=int, default=8)
    index.add_argument("--log-level", default="info")

    pack = sub.add_parser("pack", help="turn a directory tree into WebDataset tar shards")
    from shardfs.pack import configure_pack_parser
    configure_pack_parser(pack)

    demo = sub.add_parser("demo", help="run a small end-to-end demo on loopback")
    demo.add_argument("--workdir", help="keep the demo's files here (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "mount":
        code = run_mount_foreground(args) if args.foreground else run_mount_daemon(argv)
    elif args.command == "umount":
        code = run_umount(args)
    elif args.command == "index":
        code = run_index(args)
    elif args.command == "pack":
        from shardfs.pack import run_pack
        code = run_pack(args)
    elif args.command == "demo":
        from shardfs.demo import run_demo
        code = run_demo(args)
    else:  # pragma: no cover - argparse enforces the choices
        code = 2
    sys.exit(code)
