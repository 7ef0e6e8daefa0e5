"""`python -m bench s3`: shardfs and the loaders people rewrite their code for (litdata,
MosaicML Streaming, webdataset, wids, Ray Data), all reading one S3 bucket on SeaweedFS behind
the emulated link (bench/s3store.py). Scenarios: `s3` (cold epoch with every cache emptied,
then a warm epoch on the same caches) and `s3-over` (each cache limited to a quarter of the
dataset; two epochs, FUSE mounts remounted between). `--rounds N` repeats everything with the
contenders in turns (the order rotated each round), so ranges come from one sitting.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import procs
from bench.contenders import Contender
from bench.convert import to_litdata, to_mds
from bench.data import DataParams, prepare_dataset
from bench.peers import S3_CONTENDER_NAMES, S3Ctx, s3_contenders
from bench.run import QUICK, REPO, Bench, dataset_record, host_info, run_and_save
from bench.s3store import S3Proxy, tree_cpu_seconds
from bench.server import PortCap
from shardfs.devtools.seaweed import WeedServer

SCHEMA = "shardfs-bench-s3/1"
SCENARIOS = ("s3", "s3-over")
EPOCHS = {"s3": ("cold", "warm"), "s3-over": ("epoch1", "epoch2")}
CACHE_SCENARIO = {"s3": "main", "s3-over": "over"}  # what the contenders' setup() expects
BUCKET = "bench"
READER = ("BENCHREADERKEY00", "bench-reader-secret")


class S3Bench(Bench):
    """bench/run.py's Bench (epoch processes, per-epoch accounting) over the S3 store: its
    `nginx` is the latency proxy (requests and bytes from its access log), its `cap` the
    port's tbf."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.weed: WeedServer | None = None

    def server_cpu(self) -> tuple[float, float]:
        """(SeaweedFS, the latency proxy) CPU seconds so far."""
        assert self.nginx is not None and self.weed is not None
        return (procs.cpu_seconds(self.weed.pid) or 0.0,
                tree_cpu_seconds(self.nginx.pid) or 0.0)

    def run_one(self, c: Contender, scenario: str, ctx: S3Ctx) -> dict:
        reason = c.unavailable()
        if reason:
            return {"status": "unavailable", "reason": reason}
        cache_scenario = CACHE_SCENARIO[scenario]
        reason = c.not_applicable(cache_scenario, ctx)
        if reason:
            return {"status": "n/a", "reason": reason}
        assert self.nginx is not None
        rec: dict = {"status": "ok", "epochs": {}}

        def body() -> None:
            self.set_up(c, ctx, cache_scenario, rec)
            peak = 0
            epochs = EPOCHS[scenario][: self.args.epochs or None]
            for i, name in enumerate(epochs):
                if i == 0:
                    c.before_cold_epoch(ctx)
                elif scenario == "s3-over" and c.fuse:
                    peak = max(peak, procs.peak_rss(c.pid) or 0)
                    c.remount(ctx, cache_scenario)
                w0, p0 = self.server_cpu()
                e = self.one_epoch(c, ctx, name, False)
                w1, p1 = self.server_cpu()
                e["server_cpu_s"] = round(w1 - w0 + p1 - p0, 3)
                e["proxy_cpu_s"] = round(p1 - p0, 3)  # of server_cpu_s
                rec["epochs"][name] = e
                if self.timed_out(rec, name, e, ctx):
                    break
            rec["daemon_peak_rss_bytes"] = max(peak, procs.peak_rss(c.pid) or 0) or None
            assert self.weed is not None
            rec["server_rss_bytes"] = procs.peak_rss(self.weed.pid, "VmRSS")
        return self.guarded(c, rec, body)

    def run(self) -> dict:
        a = self.args
        out = Path(a.out).resolve()
        data_dir = out / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        work = out / f"work-s3-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        work.mkdir(parents=True)
        cache_root = Path(tempfile.mkdtemp(prefix="sfs3-"))
        record: dict = {
            "schema": SCHEMA, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": a.argv or "python -m bench " + shlex.join(sys.argv[1:]),
            "config": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
            "host": host_info(), "rounds": [],
        }
        contenders = [c for c in s3_contenders() if c.name in a.contenders]
        record["contenders"] = {c.name: {"label": c.label, "how": c.how, "version": c.version(),
                                         "unavailable": c.unavailable()} for c in contenders}
        env_before = dict(os.environ)
        try:
            params = DataParams(classes=a.classes, per_class=a.per_class, mean_kb=a.mean_kb,
                                shard_mb=a.shard_mb, seed=a.seed)
            data = prepare_dataset(params, data_dir, self.say)
            record["dataset"] = dataset_record(data)
            wanted = set(a.contenders)
            conv = {}
            if "litdata" in wanted:
                conv["litdata"] = to_litdata(data, data_dir, self.say)
            if "mosaic" in wanted:
                conv["mds"] = to_mds(data, data_dir, self.say)
            record["conversions"] = {k: {kk: vv for kk, vv in v.items() if kk != "params"}
                                     for k, v in conv.items() if v}
            # Under the short temp dir: weed binds Unix sockets there (AF_UNIX: ~108 bytes).
            self.weed = WeedServer(cache_root / "weed", {"reader": (*READER, ["Read", "List"])},
                                   volume_size_mb=256).start()
            self.say(f"SeaweedFS (pid {self.weed.pid}) at {self.weed.url}")
            prefixes = self.upload(data, conv)
            record["upload_s"] = prefixes.pop("_s")
            self.nginx = S3Proxy(self.weed.port, work / "proxy", latency_s=a.latency_ms / 1000)
            self.nginx.start()
            endpoint = self.nginx.url
            self.say(f"latency proxy (nginx pid {self.nginx.pid}) at {endpoint}, "
                     f"{a.latency_ms:g} ms per request")
            set_client_env(endpoint)
            import boto3
            from botocore.config import Config

            signer = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=READER[0],
                                  aws_secret_access_key=READER[1], region_name="us-east-1",
                                  config=Config(s3={"addressing_style": "path"},
                                                signature_version="s3v4"))

            def presign(key: str) -> str:
                return signer.generate_presigned_url(
                    "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=7 * 86400)

            ctx = S3Ctx(work=work, base_url=f"s3://{BUCKET}", data=data, meta=None,
                        cache_root=cache_root, workers=a.workers, batch_size=a.batch_size,
                        seed=a.seed, say=self.say,
                        fits_cache_bytes=max(2 * data.shard_bytes, 64 << 20),
                        over_cache_bytes=data.shard_bytes // 4,
                        shardfs_args=tuple(a.shardfs_arg), bucket=BUCKET, endpoint=endpoint,
                        key=READER[0], secret=READER[1], presign=presign,
                        dataset_bytes=data.loose_bytes, prefixes=prefixes)
            record["cache_sizes"] = {"s3": ctx.fits_cache_bytes, "s3-over": ctx.over_cache_bytes}
            with PortCap(self.nginx.port, None if a.no_tc else a.rate, burst=a.burst) as cap:
                self.cap = cap  # type: ignore[assignment]
                record["link"] = {"cap": cap.describe(), "active": cap.active,
                                  "bytes_per_s": cap.bytes_per_s, "rate": a.rate,
                                  "latency_ms": a.latency_ms}
                self.say(f"link: {cap.describe()}")
                for r in range(a.rounds):
                    k = r % len(contenders)
                    order = contenders[k:] + contenders[:k]  # in turns
                    rnd: dict = {"order": [c.name for c in order], "scenarios": {}}
                    for scenario in a.scenarios:
                        self.say(f"round {r + 1}/{a.rounds}, scenario {scenario}")
                        res = {c.name: self.run_one(c, scenario, ctx) for c in order}
                        rnd["scenarios"][scenario] = {c.name: res[c.name] for c in contenders}
                    record["rounds"].append(rnd)
        finally:
            if self.active is not None:
                with contextlib.suppress(Exception):
                    self.active.teardown()
            if self.nginx is not None:
                self.nginx.stop()
            if self.weed is not None:
                record["server_log_tail"] = self.weed.log_path.read_text(
                    errors="replace")[-1500:] if self.weed.log_path.exists() else ""
                self.weed.stop()
            for m in [m for m in work.glob("mnt-*") if procs.is_mounted(m)]:
                procs.unmount(m)
            os.environ.clear()
            os.environ.update(env_before)
            if not a.keep_work:
                shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(cache_root, ignore_errors=True)
        record["duration_s"] = round(time.monotonic() - self.t0, 1)
        return record

    def upload(self, data, conv: dict) -> dict:
        """Every format into the bucket, straight to SeaweedFS (not through the link)."""
        assert self.weed is not None
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=self.weed.url,
                              aws_access_key_id=self.weed.admin_keys[0],
                              aws_secret_access_key=self.weed.admin_keys[1],
                              region_name="us-east-1",
                              config=Config(s3={"addressing_style": "path"},
                                            max_pool_connections=16))
        client.create_bucket(Bucket=BUCKET)
        base = data.www.name
        prefixes = {"shards": f"{base}/shards", "loose": f"{base}/loose"}
        jobs = [(p, f"{base}/shards/{p.name}") for p in sorted(data.shards.iterdir())
                if p.is_file()]
        jobs += [(p, f"{base}/loose/{p.relative_to(data.loose).as_posix()}")
                 for p in sorted(data.loose.rglob("*")) if p.is_file()]
        for what, info in conv.items():
            if not info:
                continue
            root = Path(info["dir"])
            prefixes[what] = f"{base}/{what}"
            jobs += [(p, f"{base}/{what}/{p.relative_to(root).as_posix()}")
                     for p in sorted(root.rglob("*")) if p.is_file()]
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: client.upload_file(str(j[0]), BUCKET, j[1]), jobs))
        took = time.monotonic() - t
        self.say(f"uploaded {len(jobs)} objects in {took:.1f} s")
        prefixes["_s"] = round(took, 3)  # type: ignore[assignment]
        return prefixes


def set_client_env(endpoint: str) -> None:
    """What every client (shardfs daemon, epoch processes, their workers) reads: the reader's
    keys and the proxy as endpoint; nothing from the user's own AWS config."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[k]
    os.environ.update({
        "AWS_ACCESS_KEY_ID": READER[0], "AWS_SECRET_ACCESS_KEY": READER[1],
        "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint,  # MosaicML Streaming's
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null", "AWS_CONFIG_FILE": "/dev/null",
        "AWS_EC2_METADATA_DISABLED": "true",
    })


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the documented configuration")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--classes", type=int, default=QUICK["classes"])
    p.add_argument("--per-class", type=int, default=None)
    p.add_argument("--mean-kb", type=float, default=QUICK["mean_kb"])
    p.add_argument("--shard-mb", type=float, default=None)
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="per-request delay at the proxy (default 20)")
    p.add_argument("--rate", default="800mbit", help="cap on the proxy's replies (tc tbf)")
    p.add_argument("--burst", default="1mb")
    p.add_argument("--no-tc", action="store_true", help="no bandwidth cap")
    p.add_argument("--contenders", default=",".join(S3_CONTENDER_NAMES),
                   help="comma-separated subset of: " + ", ".join(S3_CONTENDER_NAMES))
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of: " + ", ".join(SCENARIOS))
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every scenario N times, contenders in turns (default 1)")
    p.add_argument("--epochs", type=int, default=None, help="only the first N epochs")
    p.add_argument("--epoch-limit", type=float, default=None,
                   help="seconds an epoch may run (default 90 x --scale)")
    p.add_argument("--shardfs-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--out", default=str(REPO / "bench" / "out"))
    p.add_argument("--json", help="write the record here (default OUT/s3-STAMP.json)")
    p.add_argument("--docs", help="put the section into this page (between its markers)")
    p.add_argument("--keep-work", action="store_true")
    p.add_argument("--argv", default=None, help=argparse.SUPPRESS)


def finish_args(a: argparse.Namespace) -> argparse.Namespace:
    from bench.run import _names

    if a.per_class is None:
        a.per_class = max(1, round(QUICK["per_class"] * a.scale))
    if a.shard_mb is None:
        a.shard_mb = QUICK["shard_mb"] * a.scale
    if a.epoch_limit is None:
        a.epoch_limit = 90.0 * a.scale
    a.contenders = _names(a.contenders, S3_CONTENDER_NAMES, "contender")
    a.scenarios = _names(a.scenarios, SCENARIOS, "scenario")
    return a


def s3_command(a: argparse.Namespace) -> int:
    a = finish_args(a)
    bench = S3Bench(a)
    record, path = run_and_save(bench, "s3")
    from bench.s3report import summary_lines, write_section

    if a.docs:
        write_section(Path(a.docs), record, path.name)
        bench.say(f"section written to {a.docs}")
    for line in summary_lines(record):
        print(line)
    return 0
