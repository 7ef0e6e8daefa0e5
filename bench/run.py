"""The benchmark run: data, server, bandwidth cap, every contender in every scenario, one JSON
record. Cleans up mounts, servers and the tc qdisc whatever happens."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench import procs
from bench.contenders import (
    CONTENDER_NAMES,
    DEFAULT_CONTENDERS,
    Contender,
    Ctx,
    all_contenders,
)
from bench.data import DataParams, prepare_dataset, prepare_meta
from bench.server import BandwidthCap, PortCap, Traffic, listing_nginx
from shardfs.devtools.nginx import Nginx

SCHEMA = "shardfs-bench/1"
REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("main", "small", "over", "meta", "resume")
DEFAULT_SCENARIOS = ("main", "small", "over", "meta")  # resume: asked for by name
SCENARIO_TITLES = {
    "main": "dataset fits the cache: cold epoch, warm epoch, decode epoch",
    "small": "small files (~20 KiB mean), dataset fits the cache: cold and warm epochs",
    "over": "dataset ~4x shardfs's --cache-size: two epochs, FUSE mounts remounted between",
    "meta": "metadata only: find + ImageFolder(root) over many tiny members",
    "resume": "dataset ~4x the cache, torchdata's StatefulDataLoader: half a cold epoch, its "
              "state saved, then a new process resumes it (same mount)",
}
MAIN_EPOCHS = (("cold", False), ("warm", False), ("decode", True))
SMALL_EPOCHS = (("cold", False), ("warm", False))
OVER_EPOCHS = (("epoch1", False), ("epoch2", False))
RESUME_EPOCHS = (("half", False), ("resumed", False))
RESULT_PREFIX = "RESULT "

QUICK = dict(classes=10, per_class=100, mean_kb=110.0, small_kb=20.0, shard_mb=4.0,
             meta_files=100_000, meta_dirs=1000)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.nginx: Nginx | None = None
        self.cap: BandwidthCap | None = None
        self.active: Contender | None = None

    def say(self, text: str) -> None:
        print(f"[bench +{time.monotonic() - self.t0:6.1f}s] {text}", flush=True)

    # -- the epoch subprocess ---------------------------------------------------------------
    def epoch(self, spec: dict, limit_s: float) -> dict:
        spec = {"workers": self.args.workers, "batch_size": self.args.batch_size,
                "seed": self.args.seed, "limit_s": limit_s, **spec}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        proc = subprocess.Popen([sys.executable, "-m", "bench.epoch", json.dumps(spec)],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=env, start_new_session=True)
        chunks: list[bytes] = []
        import threading

        reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
        reader.start()
        hard = time.monotonic() + limit_s + 60
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > hard and not killed:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # our child's own process group
                killed = True
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(ProcessLookupError):  # leftover loader workers, if any
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(10)
        out = b"".join(chunks).decode(errors="replace")
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith(RESULT_PREFIX)),
                    None)
        if line is None:
            why = f"killed after {limit_s + 60:.0f} s" if killed else \
                f"exit status {proc.returncode}"
            raise RuntimeError(f"epoch process produced no result ({why})")
        result = json.loads(line[len(RESULT_PREFIX):])
        result["client_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 3)
        result["client_maxrss_bytes"] = usage.ru_maxrss * 1024
        return result

    # -- one contender in one scenario --------------------------------------------------------
    def traffic(self) -> dict:
        assert self.nginx is not None
        return Traffic.of(self.nginx.access_log()).as_dict()

    def run_contender(self, c: Contender, scenario: str, ctx: Ctx) -> dict:
        reason = c.unavailable()
        if reason:
            self.say(f"  {c.name}: unavailable: {reason}")
            return {"status": "unavailable", "reason": reason}
        reason = c.not_applicable(scenario, ctx)
        if scenario == "resume" and not c.resumable:
            reason = "no sampler state: map-style shardfs contenders only"
        if reason:
            return {"status": "n/a", "reason": reason}
        if scenario == "resume" and importlib.util.find_spec("torchdata") is None:
            return {"status": "unavailable",
                    "reason": "torchdata not installed (pip install -e '.[bench]')"}
        assert self.nginx is not None
        rec: dict = {"status": "ok", "epochs": {}}

        def body() -> None:
            self.set_up(c, ctx, scenario, rec)
            rec["pid"] = c.pid
            self.say(f"  {c.name}: set up in {rec['setup']['s']:.2f} s "
                     f"({rec['setup']['requests']} requests, "
                     f"{rec['setup']['bytes'] / 1e6:.1f} MB)")
            peak = 0
            if scenario == "meta":
                self.meta_epoch(c, ctx, rec)
            else:
                epochs = {"main": MAIN_EPOCHS, "small": SMALL_EPOCHS,
                          "resume": RESUME_EPOCHS}.get(scenario, OVER_EPOCHS)
                if self.args.epochs and scenario != "resume":  # its two halves are one epoch
                    epochs = epochs[: self.args.epochs]
                for i, (name, decode) in enumerate(epochs):
                    if i == 0:
                        c.before_cold_epoch(ctx)
                    elif scenario == "over" and c.fuse:
                        # Without this the second epoch is the kernel's page cache (keep_cache),
                        # not the contender's cache policy; the daemon's disk cache is kept.
                        peak = max(peak, procs.peak_rss(c.pid) or 0)
                        t = time.monotonic()
                        c.remount(ctx, scenario)
                        rec[f"remount_before_{name}_s"] = round(time.monotonic() - t, 3)
                    e = self.one_epoch(c, ctx, name, decode)
                    rec["epochs"][name] = e
                    if self.timed_out(rec, name, e, ctx):
                        break
            rss = max(peak, procs.peak_rss(c.pid) or 0)
            rec["daemon_peak_rss_bytes"] = rss or None
            rec["daemon_rss_bytes"] = procs.peak_rss(c.pid, "VmRSS")  # at the end
            stats = c.stats()
            if stats is not None:
                rec["final_stats"] = stats
        return self.guarded(c, rec, body)

    def set_up(self, c: Contender, ctx: Ctx, scenario: str, rec: dict) -> None:
        """c.setup(ctx, scenario), its time and traffic into rec["setup"]."""
        assert self.nginx is not None
        self.nginx.reset_log()
        t = time.monotonic()
        c.setup(ctx, scenario)
        rec["setup"] = {"s": round(time.monotonic() - t, 3), **self.traffic()}

    def timed_out(self, rec: dict, name: str, e: dict, ctx: Ctx) -> bool:
        """Whether epoch `name` (its record e) hit --epoch-limit; if so rec says so."""
        if not e.get("timed_out"):
            return False
        rec["status"] = "timeout"
        rec["reason"] = (f"{name} epoch stopped after {self.args.epoch_limit:g} s"
                         f" ({e['files']} of {ctx.data.files} files)")
        return True

    def guarded(self, c: Contender, rec: dict, body: Callable[[], None]) -> dict:
        """Runs body (contender c's set-up and epochs, filling rec): a failure goes into rec,
        never up; c is torn down and its notes kept whatever happened."""
        self.active = c
        try:
            body()
        except Exception as exc:  # reported, never dropped
            rec["status"] = "failed"
            rec["reason"] = f"{type(exc).__name__}: {exc}".strip()
            rec["traceback"] = traceback.format_exc(limit=4)
            self.say(f"  {c.name}: FAILED: {rec['reason'][:300]}")
        finally:
            try:
                c.teardown()
            except Exception as exc:
                rec.setdefault("teardown_error", f"{type(exc).__name__}: {exc}")
            if c.notes:
                rec["notes"] = list(c.notes)
                c.notes.clear()
            self.active = None
        return rec

    def one_epoch(self, c: Contender, ctx: Ctx, name: str, decode: bool) -> dict:
        assert self.nginx is not None
        self.nginx.reset_log()
        before = c.stats()
        cpu0 = procs.cpu_seconds(c.pid)
        # FUSE worker processes (shardfs --workers) serve reads too: their CPU counts apart.
        worker_pids = (before or {}).get("workers") or []
        wcpu0 = {pid: procs.cpu_seconds(pid) for pid in worker_pids}
        sent0 = self.cap.sent_bytes() if self.cap is not None else None
        spec = c.spec(ctx, decode)
        if name in ("half", "resumed"):  # the resume scenario: see resume_spec
            spec["resume"] = self.resume_spec(c, ctx, name)
        e = self.epoch(spec, self.args.epoch_limit)
        sent1 = self.cap.sent_bytes() if self.cap is not None else None
        cpu1 = procs.cpu_seconds(c.pid)
        wcpu1 = {pid: procs.cpu_seconds(pid) for pid in worker_pids}
        t = self.traffic()
        e.update(requests=t["requests"], nginx_bytes=t["bytes"], http_errors=t["errors"])
        # All loopback traffic through the cap during the epoch (requests, responses, acks):
        # what crossed the link, unlike nginx_bytes (see BandwidthCap.sent_bytes).
        e["link_bytes"] = sent1 - sent0 if sent0 is not None and sent1 is not None else None
        e["decode"] = decode
        if decode:  # decoded batches carry tensors, not lengths; every file is read fully
            e["bytes_read"] = round(ctx.data.loose_bytes * e["files"] / ctx.data.files)
        else:
            e["bytes_read"] = e["bytes"]
        e["daemon_cpu_s"] = round(cpu1 - cpu0, 3) if cpu0 is not None and cpu1 is not None \
            else None
        if worker_pids:
            e["workers_cpu_s"] = round(sum(wcpu1[p] - wcpu0[p] for p in worker_pids
                                           if wcpu0[p] is not None and wcpu1[p] is not None), 3)
        stats = c.stats()
        if stats is not None:
            e["shardfs_stats"] = stats
            with contextlib.suppress(KeyError, TypeError):
                # Reads that reached the daemon (the rest were the kernel's page cache).
                e["daemon_reads"] = stats["reader"]["reads"] - before["reader"]["reads"]
        rate = e["files"] / e["iterate_s"] if e["iterate_s"] > 0 else 0
        self.say(f"  {c.name}: {name} epoch: {e['files']} files in {e['iterate_s']:.2f} s "
                 f"({rate:.0f} files/s, {e['bytes_read'] / e['iterate_s'] / 1e6:.1f} MB/s), "
                 f"first batch {e['ttfb_s'] or 0:.2f} s, {e['requests']} requests, "
                 f"{e['nginx_bytes'] / 1e6:.1f} MB from nginx"
                 + (f", {e['link_bytes'] / 1e6:.1f} MB on the link" if e["link_bytes"] else ""))
        return e

    def resume_spec(self, c: Contender, ctx: Ctx, name: str) -> dict:
        """Stop after half the epoch's batches and save the loader's state; then resume it in
        a new process (a restarted job)."""
        batches = -(-ctx.data.files // self.args.batch_size)
        return {"phase": "first" if name == "half" else "rest",
                "state": str(ctx.work / f"resume-{c.name}.pt"), "stop_after": batches // 2}

    def meta_epoch(self, c: Contender, ctx: Ctx, rec: dict) -> None:
        assert self.nginx is not None
        self.nginx.reset_log()
        cpu0 = procs.cpu_seconds(c.pid)
        e = self.epoch({"kind": "meta", "root": str(c.meta_root())}, self.args.meta_limit)
        cpu1 = procs.cpu_seconds(c.pid)
        e.update(self.traffic())
        e["daemon_cpu_s"] = round(cpu1 - cpu0, 3) if cpu0 is not None and cpu1 is not None \
            else None
        rec["epochs"]["meta"] = e
        if e.get("timed_out"):
            rec["status"] = "timeout"
            rec["reason"] = (f"find stopped after {self.args.meta_limit:g} s "
                             f"({e['find_entries']} entries listed)")
            self.say(f"  {c.name}: {rec['reason']}")
            return
        self.say(f"  {c.name}: find: {e['find_entries']} entries in {e['find_s']:.2f} s; "
                 f"ImageFolder: {e['imagefolder_files']} files in {e['imagefolder_s']:.2f} s; "
                 f"{e['requests']} requests")

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        out = Path(a.out).resolve()
        data_dir = out / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        work = out / f"work-{stamp}-{os.getpid()}"
        work.mkdir(parents=True)
        cache_root = Path(tempfile.mkdtemp(prefix="sfbench-"))  # see Ctx.cache_root
        record: dict = {
            "schema": SCHEMA,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": "python -m bench " + shlex.join(sys.argv[1:]) if a.argv is None
            else a.argv,
            "config": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
            "host": host_info(),
            "scenarios": {},
        }
        # In the order given (to run two contenders in turns both ways round).
        by_name = {c.name: c for c in all_contenders()}
        contenders = [by_name[name] for name in dict.fromkeys(a.contenders)]
        record["contenders"] = {c.name: {"label": c.label, "how": c.how, "version": c.version(),
                                         "unavailable": c.unavailable()} for c in contenders}
        scenarios = [s for s in SCENARIOS if s in a.scenarios]
        try:
            params = DataParams(classes=a.classes, per_class=a.per_class, mean_kb=a.mean_kb,
                                shard_mb=a.shard_mb, seed=a.seed)
            data = prepare_dataset(params, data_dir, self.say)
            meta = None
            if "meta" in scenarios:
                meta = prepare_meta(a.meta_files, a.meta_dirs, a.meta_loose, data_dir, self.say)
            record["dataset"] = dataset_record(data)
            small = None
            if "small" in scenarios:
                small = prepare_dataset(DataParams(
                    classes=a.classes, per_class=a.per_class, mean_kb=a.small_kb,
                    shard_mb=round(a.shard_mb * a.small_kb / a.mean_kb, 3), seed=a.seed),
                    data_dir, self.say)
                record["small_dataset"] = dataset_record(small)
            if meta is not None:
                record["meta_dataset"] = {"files": meta.files, "dirs": meta.dirs,
                                          "tar_bytes": meta.tar_bytes, "loose": meta.loose}
            self.nginx = listing_nginx(data_dir, work / "nginx", a.latency_ms / 1000)
            self.nginx.start()
            self.say(f"nginx (pid {self.nginx.pid}) at {self.nginx.url}, "
                     f"{a.latency_ms:g} ms per request")
            ctx = Ctx(work=work, base_url=self.nginx.url, data=data, meta=meta,
                      cache_root=cache_root,
                      workers=a.workers, batch_size=a.batch_size, seed=a.seed, say=self.say,
                      fits_cache_bytes=max(2 * data.shard_bytes, 64 << 20),
                      over_cache_bytes=data.shard_bytes // 4,
                      shardfs_args=tuple(a.shardfs_arg))
            record["cache_sizes"] = {"main": ctx.fits_cache_bytes, "over": ctx.over_cache_bytes}
            ctxs = {s: ctx for s in scenarios}
            if small is not None:
                ctxs["small"] = dataclasses.replace(
                    ctx, data=small, fits_cache_bytes=max(2 * small.shard_bytes, 64 << 20))
            with link_cap(a, self.nginx.port) as cap:
                self.cap = cap
                record["link"] = {"cap": cap.describe(), "active": cap.active,
                                  "bytes_per_s": cap.bytes_per_s, "rate": a.rate,
                                  "latency_ms": a.latency_ms, "queue_ms": a.queue_ms}
                self.say(f"link: {cap.describe()}")
                for scenario in scenarios:
                    self.say(f"scenario {scenario}: {SCENARIO_TITLES[scenario]}")
                    results = {}
                    for c in contenders:
                        results[c.name] = self.run_contender(c, scenario, ctxs[scenario])
                    record["scenarios"][scenario] = results
        finally:
            if self.active is not None:  # interrupted mid-contender
                with contextlib.suppress(Exception):
                    self.active.teardown()
            if self.nginx is not None:
                self.nginx.stop()
            leftovers = [str(m) for m in work.glob("mnt-*") if procs.is_mounted(m)]
            for m in leftovers:
                procs.unmount(Path(m))
            if leftovers:
                record["leftover_mounts"] = leftovers
            if not a.keep_work:
                shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(cache_root, ignore_errors=True)
        record["duration_s"] = round(time.monotonic() - self.t0, 1)
        return record


def link_cap(a: argparse.Namespace, port: int) -> PortCap:
    """The link the run's store sits behind: nginx's replies (`port`) capped at `--rate`, with
    a queue of `--queue-ms` (tbf's latency); uncapped with `--no-tc`."""
    return PortCap(port, None if a.no_tc else a.rate, burst=a.burst, latency=f"{a.queue_ms:g}ms")


def dataset_record(data) -> dict:
    return {**asdict(data.params), "files": data.files, "bytes": data.loose_bytes,
            "shards": len(data.shard_names), "shard_bytes": data.shard_bytes,
            "gen_s": data.gen_s, "pack_s": data.pack_s}


def host_info() -> dict:
    import torch

    info = {"python": platform.python_version(), "kernel": platform.release(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "nginx": None}
    with contextlib.suppress(OSError):
        r = subprocess.run(["nginx", "-v"], capture_output=True, text=True)
        info["nginx"] = r.stderr.strip()
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        info["mem_bytes"] = int(f.readline().split()[1]) * 1024
    return info


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the documented quick configuration (the default sizes; < ~10 min)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply files per class and metadata members (10 -> 10k files, 1M "
                   "members)")
    p.add_argument("--classes", type=int, default=QUICK["classes"])
    p.add_argument("--per-class", type=int, default=None,
                   help=f"files per class (default {QUICK['per_class']} x --scale)")
    p.add_argument("--mean-kb", type=float, default=QUICK["mean_kb"],
                   help="mean file size in KiB (110: ImageNet-like; 20: small files)")
    p.add_argument("--small-kb", type=float, default=QUICK["small_kb"],
                   help="mean file size of the 'small' scenario's dataset (default 20 KiB; "
                   "same file count, shards scaled to keep their count)")
    p.add_argument("--shard-mb", type=float, default=None,
                   help=f"target shard size in MiB (default {QUICK['shard_mb']:g} x --scale, "
                   "so the shard count stays put)")
    p.add_argument("--meta-files", type=int, default=None,
                   help=f"members in the metadata tar (default {QUICK['meta_files']} x --scale)")
    p.add_argument("--meta-dirs", type=int, default=QUICK["meta_dirs"])
    p.add_argument("--meta-loose", action=argparse.BooleanOptionalAction, default=None,
                   help="also write the loose tree for local disk and per-file HTTP (default: "
                   "up to 200k members)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="per-request delay at nginx (default 20)")
    p.add_argument("--rate", default="800mbit", help="loopback cap for tc tbf (default 800mbit)")
    p.add_argument("--burst", default="1mb")
    p.add_argument("--queue-ms", type=float, default=100.0,
                   help="the link's queue: tc tbf's latency, the longest a reply may wait in "
                   "it (default 100)")
    p.add_argument("--no-tc", action="store_true", help="no bandwidth cap")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help="comma-separated subset of: " + ", ".join(CONTENDER_NAMES)
                   + " (default: all but " + ", ".join(n for n in CONTENDER_NAMES
                                                       if n not in DEFAULT_CONTENDERS) + ")")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(SCENARIOS)
                   + f" (default: {','.join(DEFAULT_SCENARIOS)})")
    p.add_argument("--epochs", type=int, default=None,
                   help="run only the first N epochs of each scenario (smoke tests)")
    p.add_argument("--epoch-limit", type=float, default=None,
                   help="seconds an epoch may run before it is stopped and reported as a "
                   "timeout (default 90 x --scale)")
    p.add_argument("--meta-limit", type=float, default=None,
                   help="seconds the metadata pass may run (default 30 x --scale)")
    p.add_argument("--shardfs-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every `shardfs mount` (repeat it: "
                   "--shardfs-arg=--push-pages --shardfs-arg=off)")
    p.add_argument("--out", default=str(REPO / "bench" / "out"),
                   help="results, data and scratch (default bench/out)")
    p.add_argument("--json", help="write the record here (default OUT/run-STAMP.json)")
    p.add_argument("--docs", help="regenerate this markdown page from the record, e.g. "
                   "docs/benchmarks.md (the PNG goes next to it unless --png)")
    p.add_argument("--png", help="chart path (default: the --docs path with .png)")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch dir")
    p.add_argument("--argv", default=None, help=argparse.SUPPRESS)


def finish_args(a: argparse.Namespace) -> argparse.Namespace:
    if a.per_class is None:
        a.per_class = max(1, round(QUICK["per_class"] * a.scale))
    if a.shard_mb is None:
        a.shard_mb = QUICK["shard_mb"] * a.scale
    if a.meta_files is None:
        a.meta_files = max(1, round(QUICK["meta_files"] * a.scale))
    if a.meta_loose is None:
        a.meta_loose = a.meta_files <= 200_000
    if a.epoch_limit is None:
        a.epoch_limit = 90.0 * a.scale
    if a.meta_limit is None:
        a.meta_limit = 30.0 * a.scale
    a.contenders = _names(a.contenders, CONTENDER_NAMES, "contender")
    a.scenarios = _names(a.scenarios, SCENARIOS, "scenario")
    return a


def _names(text: str | list, allowed, what: str) -> list[str]:
    names = text if isinstance(text, list) else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"bench: unknown {what}(s): {', '.join(bad)} "
                         f"(choose from {', '.join(allowed)})")
    return names


def run_and_save(bench: Bench, prefix: str) -> tuple[dict, Path]:
    """bench.run() with SIGTERM turned into an exception (so every finally runs: tc, mounts,
    servers), its record written to --json or --out/PREFIX-<time>.json: (record, path)."""
    a = bench.args

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        record = bench.run()
    finally:
        signal.signal(signal.SIGTERM, old)
    path = (Path(a.json) if a.json
            else Path(a.out) / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    bench.say(f"record written to {path}")
    return record, path


def run_command(a: argparse.Namespace) -> int:
    a = finish_args(a)
    bench = Bench(a)
    record, path = run_and_save(bench, "run")
    if a.docs:
        from bench.report import write_docs

        md, png = write_docs(record, Path(a.docs), Path(a.png) if a.png else None,
                             record_path=path)
        bench.say(f"docs written to {md}" + (f" and {png}" if png else
                                             " (no chart: matplotlib is not installed)"))
    from bench.report import summary_lines

    for line in summary_lines(record):
        print(line)
    return 0
