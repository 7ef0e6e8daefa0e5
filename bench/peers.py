"""The contenders of the `s3` scenario: the same images read from one S3 bucket (SeaweedFS
behind the emulated link, bench/s3store.py) by shardfs and by the loaders people rewrite their
code for. Each peer is configured as its docs recommend; the links are in `how` and in
bench/peer_epoch.py.

shardfs's three contenders are bench/contenders.py's own classes: with `base_url`
`s3://BUCKET` their source pattern is `s3://BUCKET/<dataset>/shards/train-{...}.tar`, signed
with the keys in the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.contenders import (
    Contender,
    Ctx,
    Shardfs,
    ShardfsLookahead,
    ShardfsSampler,
    WebDatasetStream,
    Wids,
    _pkg_version,
)


@dataclass
class S3Ctx(Ctx):
    bucket: str = ""
    endpoint: str = ""  # the proxy (latency + cap) in front of SeaweedFS
    key: str = ""
    secret: str = ""
    presign: Callable[[str], str] | None = None  # object key -> signed GET URL
    dataset_bytes: int = 0
    prefixes: dict[str, str] = field(default_factory=dict)  # what -> key prefix

    def s3_url(self, what: str) -> str:
        return f"s3://{self.bucket}/{self.prefixes[what]}"


def _missing(module: str, dist: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{dist} not installed (pip install -e '.[bench]')"
    return None


class _Scratch(Contender):
    """A peer with a local cache dir of its own, emptied for the first (cold) epoch."""

    def cache_dir(self, ctx: Ctx, scenario: str) -> Path:
        return ctx.work / f"{self.name}-cache-{scenario}"

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        self.scenario = scenario
        self.cache = self.cache_dir(ctx, scenario)
        if fresh:
            shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True, exist_ok=True)

    def cache_limit(self, ctx: Ctx) -> int | None:
        return ctx.over_cache_bytes if self.scenario == "over" else None


class LitData(_Scratch):
    name = "litdata"
    label = "litdata StreamingDataset"
    how = ("`litdata.optimize(fn, files, output_dir, chunk_bytes=<shard size>)` once (timed), "
           "uploaded; then `StreamingDataset('s3://...', storage_options={endpoint_url, keys}, "
           "shuffle=True, cache_dir=..., max_cache_size=...)` + `StreamingDataLoader` "
           "([README: stream datasets](https://github.com/Lightning-AI/litData#stream-datasets), "
           "custom S3 endpoint via `storage_options`)")

    def unavailable(self) -> str | None:
        return _missing("litdata", "litdata")

    def version(self) -> str | None:
        return _pkg_version("litdata")

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        assert isinstance(ctx, S3Ctx)
        limit = self.cache_limit(ctx)
        return {"kind": "litdata", "input_dir": ctx.s3_url("litdata"),
                "storage_options": litdata_storage_options(ctx),
                "cache_dir": str(self.cache),
                **({"max_cache_size": limit} if limit else {}), "decode": decode}


def litdata_storage_options(ctx: S3Ctx) -> dict:
    """boto3 client arguments (litdata passes them to boto3.client('s3', ...))."""
    return {"endpoint_url": ctx.endpoint, "aws_access_key_id": ctx.key,
            "aws_secret_access_key": ctx.secret, "region_name": "us-east-1"}


class Mosaic(_Scratch):
    name = "mosaic"
    label = "MosaicML Streaming"
    how = ("`streaming.MDSWriter(columns={'image': 'bytes', 'label': 'int'}, size_limit=<shard "
           "size>)` once (timed), uploaded; then `StreamingDataset(remote='s3://...', "
           "local=DIR, shuffle=True, batch_size=B, cache_limit=...)` + torch `DataLoader`, "
           "endpoint and keys from `S3_ENDPOINT_URL` / `AWS_*` "
           "([quick start](https://docs.mosaicml.com/projects/streaming/en/stable/"
           "getting_started/quick_start.html), [cloud credentials](https://docs.mosaicml.com/"
           "projects/streaming/en/stable/how_to_guides/configure_cloud_storage_credentials.html"
           "#any-s3-compatible-object-store)); package `streaming-community`")

    def unavailable(self) -> str | None:
        return _missing("streaming", "streaming-community")

    def version(self) -> str | None:
        return _pkg_version("streaming-community") or _pkg_version("mosaicml-streaming")

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        assert isinstance(ctx, S3Ctx)
        return {"kind": "mosaic", "remote": ctx.s3_url("mds"), "local": str(self.cache),
                "cache_limit": self.cache_limit(ctx), "decode": decode}


class RayS3(Contender):
    name = "ray-s3"
    label = "Ray Data from S3"
    how = ("`ray.data.read_binary_files('s3://.../loose/train', filesystem=pyarrow.fs."
           "S3FileSystem(endpoint_override=...), shuffle='files')` + `iter_batches("
           "local_shuffle_buffer_size=1000)`, `ray.init(num_cpus=<workers>)` "
           "([loading data](https://docs.ray.io/en/latest/data/loading-data.html), "
           "[iterating](https://docs.ray.io/en/latest/data/iterating-over-data.html)); one GET "
           "per file, no cache")

    def unavailable(self) -> str | None:
        return _missing("ray", "ray[data]") or _missing("pyarrow", "pyarrow")

    def version(self) -> str | None:
        return _pkg_version("ray")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        return "no cache of its own: see the cold epoch" if scenario == "over" else None

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        pass

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        assert isinstance(ctx, S3Ctx)
        endpoint = ctx.endpoint.removeprefix("http://")
        return {"kind": "ray", "paths": f"{ctx.bucket}/{ctx.prefixes['loose']}/train",
                "s3": {"key": ctx.key, "secret": ctx.secret, "endpoint": endpoint},
                "decode": decode}


class RayMount(Shardfs):
    name = "ray-shardfs"
    label = "Ray Data from the shardfs mount"
    how = ("as Ray Data from S3, reading the shardfs mount's tree "
           "(`read_binary_files('/mnt/train')`) instead of S3")

    def unavailable(self) -> str | None:
        return _missing("ray", "ray[data]")

    def version(self) -> str | None:
        return _pkg_version("ray")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        return "see the cold epoch" if scenario == "over" else None

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        assert self.root is not None
        return {"kind": "ray", "paths": str(self.root / "train"), "decode": decode}


class WebDatasetS3(WebDatasetStream):
    how = ("`webdataset.WebDataset(urls, shardshuffle=N).shuffle(1000)`, urls = presigned "
           "GET URLs (SigV4 query signing, boto3) streamed by its curl handler; no cache "
           "(its docs' other S3 route, `pipe:aws s3 cp ... -`, starts a Python CLI per shard)")

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        assert isinstance(ctx, S3Ctx) and ctx.presign is not None
        self.urls = [ctx.presign(f"{ctx.prefixes['shards']}/{n}") for n in ctx.data.shard_names]


class WidsS3(Wids):
    how = ("`wids.ShardListDataset(index.json, cache_dir=...)` + DataLoader(shuffle=True), the "
           "index listing presigned GET URLs: whole shards downloaded (curl) on first touch, "
           "kept (no eviction)")

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        assert isinstance(ctx, S3Ctx) and ctx.presign is not None
        self.cache = ctx.work / f"wids-cache-{scenario}"
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)
        index = ctx.data.wids_index("http://unused")
        for entry, name in zip(index["shardlist"], ctx.data.shard_names, strict=True):
            entry["url"] = ctx.presign(f"{ctx.prefixes['shards']}/{name}")
        self.index = ctx.work / f"wids-{scenario}.json"
        self.index.write_text(json.dumps(index, indent=1))


def s3_contenders() -> list[Contender]:
    return [Shardfs(), ShardfsSampler(), ShardfsLookahead(), WebDatasetS3(), WidsS3(),
            LitData(), Mosaic(), RayS3(), RayMount()]


S3_CONTENDER_NAMES = [c.name for c in s3_contenders()]
