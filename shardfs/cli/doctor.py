"""`shardfs doctor [MOUNTPOINT | SOURCE...]`: what blocks mounting, or makes reads slow.

Without arguments: this machine (FUSE, our shim and download thread, the default cache dir,
memory). With a running mount: that, plus the mount's own state and its sources as it sees
them (endpoints from its stats). With SOURCEs: that, plus the store (reachable, which
credentials answered, time to first byte and throughput, shard sizes against the cache size,
published indexes).
Every check prints a verdict and, when something is wrong, a fix; the exit status is 1 when
something blocks mounting or makes it slow, and the last line names it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import trio

from shardfs.cli.checks import (
    Check,
    check_body_splice,
    check_cache_dir,
    check_crc32c,
    check_dev_fuse,
    check_fusermount,
    check_kernel,
    check_local_shards,
    check_memory,
    check_mount_shim,
    check_shim,
    disk_against_store,
    in_place_judge,
    shard_storage,
)
from shardfs.cli.main import default_cache_size
from shardfs.daemon.control import ControlError, read_stats
from shardfs.daemon.mountpoint import FSTYPE, mounted_fstype
from shardfs.sources import SourceSettings
from shardfs.util.sizes import parse_size

MARK = {"ok": "ok  ", "note": "note", "slow": "SLOW", "fail": "FAIL"}


def configure_doctor_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="*", metavar="MOUNTPOINT | SOURCE",
                   help="a running shardfs mount, or shards as for mount (URLs, paths, brace "
                   "patterns, manifests); none: check this machine only")
    p.add_argument("--config", metavar="FILE", help="a mount's YAML settings: its sources, "
                   "cache, endpoints and credentials are checked (flags override it)")
    p.add_argument("--cache-dir", help="the cache dir to check (default: the mount's, or "
                   "~/.cache/shardfs)")
    p.add_argument("--cache-size", help="the cache size to check shard sizes against "
                   "(default: the mount's budget)")
    p.add_argument("--allow-other", action="store_true",
                   help="check that other users' access can be allowed (user_allow_other)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="give up on a source after this long without progress (default 5)")
    p.add_argument("--json", action="store_true", help="the checks as one JSON document")
    for flag, what in (("--s3-endpoint", "S3-compatible endpoint"), ("--s3-region", "S3 region"),
                       ("--s3-profile", "AWS profile"), ("--ais-endpoint", "AIStore gateway"),
                       ("--hf-endpoint", "Hugging Face Hub"), ("--gs-endpoint", "GCS XML API")):
        p.add_argument(flag, help=f"{what}, as for mount")
    p.add_argument("--s3-addressing", choices=("auto", "path", "virtual"),
                   help="bucket in the path or the host name, as for mount")


def _settings(args: argparse.Namespace, from_mount: dict, config: dict) -> SourceSettings:
    settings = SourceSettings(timeout=args.timeout, deadline=args.timeout)
    for key in ("s3_endpoint", "s3_region", "s3_profile", "s3_addressing", "ais_endpoint",
                "hf_endpoint", "gs_endpoint"):
        value = getattr(args, key) or from_mount.get(key) or config.get(key)
        if value is not None:
            setattr(settings, key, value)
    # The file a mount's signed-URL token is read from (its stats name it, never the token).
    settings.url_query_file = from_mount.get("url_query_file")
    if config.get("credentials"):
        from shardfs.cli.config import source_secrets

        for key, value in source_secrets(config["credentials"]).items():
            setattr(settings, key, value)
    return settings


def _default_cache_base() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "shardfs"


def diagnose(args: argparse.Namespace, config: dict) -> list[Check]:
    checks: list[Check] = []
    snapshot: dict = {}
    specs = list(args.targets) or list(config.get("sources") or [])
    if len(specs) == 1 and "://" not in specs[0] and mounted_fstype(specs[0]) == FSTYPE:
        try:
            snapshot = read_stats(os.path.abspath(specs[0]))
        except ControlError as exc:
            checks.append(Check("mount", "fail", str(exc), "remount it (shardfs umount, then "
                                "mount again)"))
            specs = []
        else:
            specs = list(snapshot.get("sources", []))
            total = snapshot.get("sources_total", len(specs))
            if total > len(specs):  # the stats list the first ones (daemon/lifecycle.py)
                checks.append(Check("sources", "note", f"the mount has {total} sources; "
                                    f"checking the first {len(specs)}"))
    checks.append(check_dev_fuse())
    checks.append(check_fusermount(args.allow_other or bool(config.get("allow_other"))))
    checks.append(check_kernel())
    checks.append(check_shim())
    checks.append(check_crc32c())
    checks.append(check_body_splice())
    if snapshot:
        checks.append(check_mount_shim(snapshot))
    cache_dir = Path(args.cache_dir or snapshot.get("cache_dir") or config.get("cache_dir")
                     or _default_cache_base())
    cache_size = parse_size(args.cache_size) if args.cache_size else \
        snapshot.get("cache_budget_bytes") or config.get("cache_size") or \
        default_cache_size(cache_dir)
    checks.extend(check_cache_dir(cache_dir, cache_size))
    # The shards fetched into the cache: those read in place are never pushed.
    fetched_bytes = snapshot.get("fetched_bytes", snapshot.get("dataset_bytes"))
    if specs:
        from shardfs.cli.config import OPTIONS
        from shardfs.cli.sourcecheck import check_sources

        absolute = [s if "://" in s else os.path.abspath(s) for s in specs]
        in_place = snapshot.get("in_place") or config.get("in_place") or \
            OPTIONS["in_place"].default
        storage = shard_storage(cache_dir)
        report = trio.run(check_sources, absolute,
                          _settings(args, snapshot.get("source_settings") or {}, config),
                          cache_size, in_place_judge(in_place, storage))
        checks.extend(report.checks)
        store = next((c for c in report.checks if c.name == "store speed"), None)
        disk = next((c for c in checks if c.name == "cache disk"), None)
        if store is not None and store.value and disk is not None:
            disk_against_store(disk, store.value)
        fetched_bytes = fetched_bytes if fetched_bytes is not None else report.fetched_bytes
        local = check_local_shards(report.local_paths, in_place, storage)
        if local is not None:
            checks.append(local)
    checks.append(check_memory(fetched_bytes))
    return checks


def summary(checks: list[Check]) -> str:
    problems = [c for c in checks if c.problem]
    if not problems:
        return "shardfs doctor: OK, nothing blocks mounting or slows reads"
    blocking = [c for c in problems if c.verdict == "fail"]
    worst = blocking[0] if blocking else problems[0]
    what = "blocks mounting" if blocking else "slows reads"
    more = f" (and {len(problems) - 1} more above)" if len(problems) > 1 else ""
    return f"shardfs doctor: {worst.name} {what}: {worst.detail}{more}"


def run_doctor(args: argparse.Namespace) -> int:
    from shardfs.cli.config import ConfigError, load_file

    try:
        if args.cache_size:
            parse_size(args.cache_size)
    except ValueError as exc:
        print(f"shardfs: error: --cache-size: {exc}", file=sys.stderr)
        return 1
    try:
        checks = diagnose(args, load_file(args.config) if args.config else {})
    except ConfigError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardfs: interrupted", file=sys.stderr)
        return 130
    code = 1 if any(c.problem for c in checks) else 0
    if args.json:
        print(json.dumps({"checks": [{"name": c.name, "verdict": c.verdict, "detail": c.detail,
                                      "fix": c.fix} for c in checks],
                          "summary": summary(checks), "ok": code == 0}, indent=2))
        return code
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"[{MARK[c.verdict]}] {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.verdict != "ok":
            print(f"       {' ' * width}  fix: {c.fix}")
    print(summary(checks))
    return code
