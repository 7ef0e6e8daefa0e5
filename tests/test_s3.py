"""S3Source and AisSource against moto's real S3 server on loopback (its own process).

moto runs with IAM authentication enforced: it recomputes every request's SigV4 signature
(with botocore) and checks the access key's IAM policy, so a wrong signature, an unknown key,
a wrong session token or a missing permission is refused the way S3 refuses it. boto3 is used
only to set up buckets and users; everything under test goes through shardfs.sources.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from shardfs.sources import (
    AisSource,
    NotFound,
    S3Source,
    ShardChanged,
    ShardInfo,
    SourceError,
    Sources,
    SourceSettings,
)
from shardfs.sources.s3 import S3Config, load_s3_config, split_bucket_url
from shardfs.sources.sigv4 import Credentials
from tests.faultproxy import FaultProxy
from tests.moto_fixture import MotoServer

T = TypeVar("T")
CHUNK = 64 * 1024
FAST = SourceSettings(timeout=2.0, deadline=4.0, backoff_initial=0.02, backoff_max=0.2,
                      chunk_size=CHUNK)
BUCKET = "shards"
SHARDS = {  # key -> size (none a multiple of anything)
    "data/train-000000.tar": 300_007,
    "data/train-000001.tar": 123_457,
    "data/train-000002.tar": 1,
    "data/a b+c=d&ሴ (1)~!.tar": 70_001,
}
MANY = 1003  # more than one ListObjectsV2 page at S3's maximum page size (1000)


def blob(key: str, size: int, version: int = 0) -> bytes:
    return random.Random(f"{key}/{version}").randbytes(size)


@dataclass
class Store:
    moto: MotoServer
    data: dict[str, bytes]
    reader: Credentials  # s3:GetObject + s3:ListBucket
    getter: Credentials  # s3:GetObject only
    nobody: Credentials  # no S3 permission at all
    admin: Any  # boto3 S3 client allowed everything (for changes after auth is on)
    role: Credentials  # temporary credentials (STS AssumeRole) with a session token
    assumer: Credentials  # may only call sts:AssumeRole (for assume-role profiles)

    def config(self, creds: Credentials | None, **kw: Any) -> S3Config:
        return S3Config(endpoint=self.moto.url, addressing="path", credentials=creds, **kw)

    def source(self, creds: Credentials | None = None, settings: SourceSettings = FAST,
               **kw: Any) -> S3Source:
        return S3Source(settings, config=self.config(creds or self.reader, **kw))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as moto:
        s3 = moto.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        data = {key: blob(key, size) for key, size in SHARDS.items()}
        data["data/empty.tar"] = b""
        data["data/notes.txt"] = b"not a shard"
        data["data/sub/deeper.tar"] = b"x" * 10
        for i in range(25):
            data[f"paged/p-{i:03d}.tar"] = b"p" * i
        data["paged/readme.md"] = b"hello"
        for key, body in data.items():
            s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        with ThreadPoolExecutor(8) as pool:  # (empty objects, not kept in `data`)
            list(pool.map(lambda i: s3.put_object(Bucket=BUCKET, Key=f"many/m-{i:05d}.tar",
                                                  Body=b""), range(MANY)))
        reader = Credentials(*moto.iam_user("reader", ["s3:GetObject", "s3:ListBucket"]),
                             source="test reader")
        getter = Credentials(*moto.iam_user("getter", ["s3:GetObject"]), source="test getter")
        nobody = Credentials(*moto.iam_user("nobody", ["iam:GetUser"]), source="test nobody")
        assumer = Credentials(*moto.iam_user("assumer", ["sts:AssumeRole"]),
                              source="test assumer")
        admin_key, admin_secret = moto.iam_user("admin", ["s3:*"])
        iam = moto.client("iam")
        trust = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]}
        role_arn = iam.create_role(RoleName="train", AssumeRolePolicyDocument=json.dumps(trust))[
            "Role"]["Arn"]
        iam.put_role_policy(RoleName="train", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))
        temp = moto.client("sts").assume_role(RoleArn=role_arn, RoleSessionName="job")[
            "Credentials"]
        role = Credentials(temp["AccessKeyId"], temp["SecretAccessKey"], temp["SessionToken"],
                           source="test role")
        moto.enforce_auth()
        admin = moto.client("s3", admin_key, admin_secret)
        yield Store(moto, data, reader, getter, nobody, admin, role, assumer)


def run(source: S3Source, fn: Callable[[S3Source], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await fn(source)
        finally:
            await source.aclose()

    return trio.run(main)


async def read(source: S3Source, shard: ShardInfo, start: int = 0, end: int | None = None
               ) -> bytes:
    end = shard.size if end is None else end
    parts = []
    async with aclosing(source.stream(shard, start, end)) as chunks:
        async for chunk in chunks:
            assert 0 < len(chunk) <= CHUNK
            parts.append(chunk)
    return b"".join(parts)


def url(key: str) -> str:
    return f"s3://{BUCKET}/{key}"


# -- stat, stream ------------------------------------------------------------------------------


def test_stat_and_stream_are_byte_exact(store: Store) -> None:
    rng = random.Random(5)

    async def check(source: S3Source) -> None:
        for key, size in SHARDS.items():
            data = store.data[key]
            shard = await source.stat(url(key))
            head = store.admin.head_object(Bucket=BUCKET, Key=key)
            assert (shard.url, shard.size, shard.etag) == (url(key), size, head["ETag"])
            spans = [(0, size), (0, 1), (size - 1, size), (size // 2, size // 2)]
            spans += [tuple(sorted((rng.randrange(size), rng.randrange(size))))
                      for _ in range(5)]
            for start, end in spans:
                assert await read(source, shard, start, end) == data[start:end], (key, start)
        empty = await source.stat(url("data/empty.tar"))
        assert empty.size == 0 and await read(source, empty) == b""
        assert source.stats.retries == 0 and source.stats.errors == 0

    run(store.source(), check)


def test_stream_resumes_through_faults(store: Store) -> None:
    """HttpSource's retry core, reused: resets mid-body are resumed from the last byte, each
    resumed request (a new Range) signed anew and verified by moto."""
    key = "data/train-000000.tar"
    with FaultProxy(store.moto.port) as proxy:
        config = dataclasses.replace(store.config(store.reader), endpoint=proxy.url)
        source = S3Source(FAST, config=config)

        async def check(source: S3Source) -> None:
            shard = await source.stat(url(key))
            proxy.reset_after(50_000)
            assert await read(source, shard) == store.data[key]
            proxy.clear()
            proxy.fail(503, times=2)
            assert await read(source, shard, 10, 20) == store.data[key][10:20]
            assert source.stats.retries >= 7

        run(source, check)
        gets = [r for r in proxy.requests if "if-match" in r.headers]
        ranges = [r.headers["range"] for r in gets]
        assert len(gets) >= 8 and len(set(ranges[:-3])) == len(ranges) - 3  # 503s: same range
        assert all(r.headers["if-match"] == gets[0].headers["if-match"] for r in gets[1:])
        assert all(r.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=")
                   for r in gets)


def test_session_token_credentials(store: Store) -> None:
    key = "data/train-000001.tar"

    async def check(source: S3Source) -> None:
        shard = await source.stat(url(key))
        assert await read(source, shard) == store.data[key]

    run(store.source(store.role), check)
    bad = dataclasses.replace(store.role, session_token=store.role.session_token[:-4] + "AAAA")

    async def refused(source: S3Source) -> None:
        with pytest.raises(SourceError, match=r"session token.*not valid") as info:
            await source.stat(url(key))
        assert not isinstance(info.value, NotFound)

    run(store.source(bad), refused)


# -- errors ------------------------------------------------------------------------------------


def test_wrong_secret_is_a_clear_error(store: Store) -> None:
    wrong = Credentials(store.reader.access_key, "not-the-secret-at-all", source="test")
    key = "data/train-000000.tar"

    async def check(source: S3Source) -> None:
        with pytest.raises(SourceError) as info:
            await source.stat(url(key))
        message = str(info.value)
        assert not isinstance(info.value, NotFound)
        assert url(key) in message and "SignatureDoesNotMatch" in message
        assert "secret key is wrong" in message and store.reader.access_key in message
        assert "not-the-secret" not in message
        shard = ShardInfo(url(key), SHARDS[key], '"x"')
        with pytest.raises(SourceError, match="SignatureDoesNotMatch"):
            await read(source, shard)
        with pytest.raises(SourceError, match="SignatureDoesNotMatch"):
            await source.fetch_optional(url(key) + ".shardfs.idx")
        with pytest.raises(SourceError, match="SignatureDoesNotMatch"):
            await source.list_prefix(url("data/"))
        assert source.stats.retries == 0

    run(store.source(wrong), check)
    unknown = Credentials("AKIAUNKNOWN000000000", "whatever", source="test")

    async def check_unknown(source: S3Source) -> None:
        with pytest.raises(SourceError, match=r"does not know access key AKIAUNKNOWN.*"
                                              r"InvalidAccessKeyId"):
            await source.stat(url(key))

    run(store.source(unknown), check_unknown)


def test_access_denied_names_the_permission(store: Store) -> None:
    async def check(source: S3Source) -> None:
        # getter may read objects but not list: the listing is refused, clearly.
        with pytest.raises(SourceError, match=r"access denied to bucket 'shards'.*"
                                              r"s3:ListBucket") as info:
            await source.list_prefix(url("data/"))
        assert not isinstance(info.value, NotFound)
        assert await source.fetch_optional(url("data/notes.txt")) == b"not a shard"

    run(store.source(store.getter), check)

    async def check_nobody(source: S3Source) -> None:
        with pytest.raises(SourceError, match=r"access denied to bucket 'shards', key "
                                              r"'data/train-000000.tar'.*s3:GetObject") as info:
            await source.stat(url("data/train-000000.tar"))
        assert not isinstance(info.value, NotFound)
        # An index file next to a shard that we may not read counts as absent.
        assert await source.fetch_optional(url("data/train-000000.tar.shardfs.idx")) is None

    run(store.source(store.nobody), check_nobody)


def test_missing_key_and_bucket(store: Store) -> None:
    async def check(source: S3Source) -> None:
        with pytest.raises(NotFound, match=r"no key 'data/missing\.tar' in bucket 'shards'"):
            await source.stat(url("data/missing.tar"))
        with pytest.raises(NotFound, match=r"no such bucket 'nobucket'"):
            await source.stat("s3://nobucket/a.tar")
        assert await source.fetch_optional(url("data/missing.tar.shardfs.idx")) is None
        assert await source.fetch_optional(url("data/notes.txt")) == b"not a shard"
        with pytest.raises(NotFound, match="no such bucket"):
            await source.list_prefix("s3://nobucket/")
        with pytest.raises(SourceError, match="names a bucket, not an object"):
            await source.stat("s3://shards")

    run(store.source(), check)


def test_changed_object_is_detected(store: Store) -> None:
    key = "data/changing.tar"
    first = blob(key, 100_000)
    store.admin.put_object(Bucket=BUCKET, Key=key, Body=first)

    async def check(source: S3Source) -> None:
        shard = await source.stat(url(key))
        assert await read(source, shard, 0, 10) == first[:10]
        store.admin.put_object(Bucket=BUCKET, Key=key, Body=blob(key, 100_000, version=1))
        with pytest.raises(ShardChanged, match=r"changing\.tar"):  # same size, new ETag
            await read(source, shard)
        fresh = await source.stat(url(key))
        assert fresh.etag != shard.etag and fresh.size == shard.size
        store.admin.put_object(Bucket=BUCKET, Key=key, Body=b"short")
        with pytest.raises(ShardChanged):
            await read(source, fresh, 0, 10)
        store.admin.delete_object(Bucket=BUCKET, Key=key)
        with pytest.raises(NotFound):
            await read(source, fresh, 0, 10)

    run(store.source(), check)


# -- listing -----------------------------------------------------------------------------------


def test_listing_is_paginated(store: Store) -> None:
    async def check(source: S3Source) -> None:
        listing = await source.list_prefix(url("many/"))  # default: 1000 per page
        assert listing.urls == [url(f"many/m-{i:05d}.tar") for i in range(MANY)]
        assert source.stats.requests == 2
        small = await source.list_prefix(url("paged/"), page_size=7)
        assert small.urls == sorted(url(k) for k in store.data if k.startswith("paged/"))
        assert source.stats.requests == 2 + 4  # 26 keys, 7 a page
        data = await source.list_prefix(url("data/"))
        keys = sorted(k for k in store.data if k.startswith("data/") and "/sub/" not in k)
        assert data.urls == [url(k) for k in keys]  # odd characters survive encoding-type=url
        assert data.prefixes == [url("data/sub/")]
        train = await source.list_prefix(url("data/train-"))
        assert len(train.urls) == 3 and not train.prefixes
        assert (await source.list_prefix(url("nothing/"))).urls == []

    run(store.source(), check)


# -- configuration -----------------------------------------------------------------------------


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def aws_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **env: str) -> None:
    """The process environment holds exactly these AWS settings (botocore reads os.environ)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_credentials_from_environment_and_files(store: Store, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    key = "data/train-000001.tar"
    creds_file = write(tmp_path / "credentials", (
        "[default]\naws_access_key_id = AKIADEFAULTWRONG0000\n"
        "aws_secret_access_key = wrong\n\n"
        f"[train]\naws_access_key_id = {store.reader.access_key}\n"
        f"aws_secret_access_key = {store.reader.secret_key}\n"))
    config_file = write(tmp_path / "config", (
        "[default]\nregion = eu-west-1\n\n"
        "[profile train]\nregion = us-east-1\n"
        f"s3 =\n    endpoint_url = {store.moto.url}\n    addressing_style = path\n"))
    base = {"AWS_SHARED_CREDENTIALS_FILE": creds_file, "AWS_CONFIG_FILE": config_file}

    def source(env: Mapping[str, str], settings: SourceSettings = FAST) -> S3Source:
        aws_only(monkeypatch, tmp_path, **env)
        return S3Source(settings)

    async def reads(source: S3Source) -> None:
        shard = await source.stat(url(key))
        assert await read(source, shard) == store.data[key]

    # A profile from the shared files: credentials, region, endpoint and addressing.
    profiled = source({**base, "AWS_PROFILE": "train"})
    assert profiled.config.region == "us-east-1" and profiled.config.addressing == "path"
    assert profiled.config.endpoint == store.moto.url
    assert "credential chain, profile 'train'" in profiled.config.describe()
    run(profiled, reads)
    assert profiled.credential_method == "shared-credentials-file"
    # Environment credentials win over the file; the endpoint comes from AWS_ENDPOINT_URL.
    env = {**base, "AWS_ACCESS_KEY_ID": store.reader.access_key,
           "AWS_SECRET_ACCESS_KEY": store.reader.secret_key,
           "AWS_ENDPOINT_URL": store.moto.url, "AWS_REGION": "us-east-1"}
    from_env = source(env)
    run(from_env, reads)
    assert from_env.credential_method == "env"
    # The settings field overrides the environment's endpoint.
    settings = dataclasses.replace(FAST, s3_endpoint=store.moto.url, s3_profile="train")
    run(source({**base, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, settings), reads)
    # The default profile's wrong key is reported as such (after one refresh, in case it
    # had just been rotated), naming the key and where it came from, never the secret.
    wrong = source({**base, "AWS_ENDPOINT_URL_S3": store.moto.url})

    async def refused(source: S3Source) -> None:
        with pytest.raises(SourceError, match=r"AKIADEFAULTWRONG0000 from the shared "
                           r"credentials file \[shared-credentials-file\]") as info:
            await source.stat(url(key))
        assert "wrong" not in str(info.value).replace("AKIADEFAULTWRONG", "")
        assert source.stats.credential_refreshes == 1

    run(wrong, refused)


def test_config_resolution_rules(tmp_path: Path) -> None:
    empty = {"HOME": str(tmp_path)}
    config = load_s3_config(SourceSettings(), empty)
    assert config == S3Config(region="us-east-1", endpoint=None, addressing="auto",
                              credentials=None, chain=True)
    env = {"HOME": str(tmp_path), "AWS_DEFAULT_REGION": "eu-west-3", "AWS_ACCESS_KEY_ID": "AK",
           "AWS_SECRET_ACCESS_KEY": "SK", "AWS_SESSION_TOKEN": "TOK",
           "AWS_ENDPOINT_URL": "http://minio:9000/", "AWS_ENDPOINT_URL_S3": "https://rgw:7480"}
    config = load_s3_config(SourceSettings(), env)
    assert config.region == "eu-west-3" and config.endpoint == "https://rgw:7480"
    assert config.credentials is None and config.chain  # found by botocore when used
    assert load_s3_config(SourceSettings(), {**env, "AWS_REGION": "ap-south-1"}).region == \
        "ap-south-1"
    ignored = load_s3_config(SourceSettings(),
                             {**env, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"})
    assert ignored.endpoint is None
    settings = SourceSettings(s3_region="us-west-2", s3_endpoint="http://h:1/prefix/",
                              s3_addressing="virtual")
    config = load_s3_config(settings, env)
    assert (config.region, config.endpoint, config.addressing) == \
        ("us-west-2", "http://h:1/prefix", "virtual")
    # The profile's region; the profile is handed to the credential chain.
    write(tmp_path / "config", "[profile p]\naws_access_key_id = A2\naws_secret_access_key = "
          "S2\naws_session_token = T2\nregion = sa-east-1\n")
    config = load_s3_config(SourceSettings(), {"HOME": str(tmp_path), "AWS_PROFILE": "p",
                                               "AWS_CONFIG_FILE": str(tmp_path / "config")})
    assert config.region == "sa-east-1" and config.profile == "p"
    # Keys from the shardfs config are fixed: no chain.
    fixed = load_s3_config(SourceSettings(s3_credentials={"access_key_id": "A",
                                                          "secret_access_key": "S"}), empty)
    assert fixed.credentials == Credentials("A", "S", None, "the shardfs config")
    assert not fixed.chain
    # Mistakes are reported, not guessed around.
    with pytest.raises(SourceError, match="profile 'nope' not found"):
        load_s3_config(SourceSettings(s3_profile="nope"), empty)
    with pytest.raises(SourceError, match="addressing 'sideways'"):
        load_s3_config(SourceSettings(s3_addressing="sideways"), empty)
    with pytest.raises(SourceError, match="endpoint 'minio:9000'"):
        load_s3_config(SourceSettings(s3_endpoint="minio:9000"), empty)
    write(tmp_path / "bad", "[default\nno closing bracket")
    with pytest.raises(SourceError, match="cannot read AWS config file"):
        load_s3_config(SourceSettings(), {"HOME": str(tmp_path),
                                          "AWS_CONFIG_FILE": str(tmp_path / "bad")})


def test_request_addressing() -> None:
    """Where requests go: virtual-hosted on AWS for DNS-safe names, path-style otherwise."""

    def target(bucket: str, **kw: Any) -> str:
        source = S3Source(SourceSettings(), config=S3Config(**kw))
        try:
            request = source._build_request(f"s3://{bucket}/a b/c+d.tar", {"Range": "bytes=0-0"})
            return str(request.url)
        finally:
            trio.run(source.aclose)

    assert target("my-bucket", region="eu-west-1") == \
        "https://my-bucket.s3.eu-west-1.amazonaws.com/a%20b/c%2Bd.tar"
    assert target("my.dotted.bucket", region="eu-west-1") == \
        "https://s3.eu-west-1.amazonaws.com/my.dotted.bucket/a%20b/c%2Bd.tar"
    assert target("b1", endpoint="http://minio:9000") == "http://minio:9000/b1/a%20b/c%2Bd.tar"
    assert target("b1", endpoint="http://gw:8080/s3", addressing="path") == \
        "http://gw:8080/s3/b1/a%20b/c%2Bd.tar"
    assert target("b1", endpoint="https://store.example", addressing="virtual") == \
        "https://b1.store.example/a%20b/c%2Bd.tar"
    assert target("bkt", region="cn-north-1").endswith(".amazonaws.com.cn/a%20b/c%2Bd.tar")
    assert split_bucket_url("s3://b/k/e y?#.tar") == ("b", "k/e y?#.tar")  # keys are literal


def test_sources_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AIS_ENDPOINT", "http://ais-gw:51080")

    async def check() -> None:
        sources = Sources(FAST)
        try:
            s3 = sources.for_url("s3://bucket/a.tar")
            assert type(s3) is S3Source and sources.for_url("S3://other/b.tar") is s3
            ais = sources.for_url("ais://bucket/a.tar")
            assert type(ais) is AisSource and ais.config.endpoint == "http://ais-gw:51080/s3"
            assert ais.config.credentials is None and ais.config.addressing == "path"
        finally:
            await sources.aclose()

    trio.run(check)


# -- AIStore (its S3 API, behind a stand-in gateway) -------------------------------------------


@contextmanager
def redirecting_gateway(upstream: str) -> Iterator[tuple[str, list[tuple[str, dict]]]]:
    """A stand-in for an AIStore gateway: answers every `/s3/...` request with a 307 to the
    same path and query (minus `/s3`) on `upstream`, as a gateway redirects to a target."""
    seen: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
            if not self.path.startswith("/s3/"):
                self.send_error(404)
                return
            self.send_response(307)
            self.send_header("Location", upstream + self.path[len("/s3"):])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_ais_through_the_s3_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ais://B/K -> GET {AIS_ENDPOINT}/s3/B/K, unsigned, redirects followed; listings too.
    (moto without authentication stands in for the AIStore targets; see docs/sources.md.)"""
    data = blob("ais", 200_003)
    with MotoServer(tmp_path / "moto") as moto:
        setup = moto.client("s3")
        setup.create_bucket(Bucket="ais-bucket")
        for key, body in (("imagenet/train-000000.tar", data), ("imagenet/train-000001.tar",
                                                                  b"x")):
            # public-read: moto's own rule for answering unsigned GETs
            setup.put_object(Bucket="ais-bucket", Key=key, Body=body, ACL="public-read")
        with redirecting_gateway(moto.url) as (gateway, seen):
            source = AisSource(dataclasses.replace(FAST, ais_endpoint=gateway), env={})

            async def check(source: S3Source) -> None:
                shard = await source.stat("ais://ais-bucket/imagenet/train-000000.tar")
                assert shard.size == len(data) and shard.etag
                assert await read(source, shard) == data
                assert await read(source, shard, 7, 70_000) == data[7:70_000]
                listing = await source.list_prefix("ais://ais-bucket/imagenet/")
                assert listing.urls == [f"ais://ais-bucket/imagenet/train-00000{i}.tar"
                                        for i in range(2)]
                assert await source.fetch_optional("ais://ais-bucket/nope.idx") is None

            run(source, check)
            paths = [path for path, _ in seen]
            assert paths[0] == "/s3/ais-bucket/imagenet/train-000000.tar"
            assert any(p.startswith("/s3/ais-bucket?") and "list-type=2" in p for p in paths)
            assert all("authorization" not in headers for _, headers in seen)
            assert seen[0][1]["range"] == "bytes=0-0"

        # Anonymous s3:// (no credentials anywhere) is unsigned as well.
        aws_only(monkeypatch, tmp_path, AWS_ENDPOINT_URL=moto.url)
        anonymous = S3Source(FAST)
        assert anonymous.config.credentials is None

        async def unsigned(source: S3Source) -> None:
            shard = await source.stat("s3://ais-bucket/imagenet/train-000001.tar")
            assert await read(source, shard) == b"x"

        run(anonymous, unsigned)
        assert anonymous.credential_method == "none"


def test_moto_serves_what_boto_wrote(store: Store) -> None:
    """Sanity check of the fixture itself: plain unsigned HTTP is refused once auth is on."""
    with pytest.raises(urllib.request.HTTPError):
        urllib.request.urlopen(f"{store.moto.url}/{BUCKET}/data/train-000002.tar", timeout=5)


def test_session_credentials_from_the_chain(store: Store, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporary credentials with a session token, obtained by botocore's chain from a real
    STS API (moto's; it checks the session token on every S3 request): an assume-role
    profile (role_arn + source_profile). (moto with auth enforced cannot answer the unsigned
    AssumeRoleWithWebIdentity; web identity is tested against SeaweedFS with an STS
    stand-in in test_s3_credentials.py.)"""
    role_arn = "arn:aws:iam::123456789012:role/train"
    key = "data/train-000000.tar"

    async def reads(source: S3Source) -> None:
        shard = await source.stat(url(key))
        assert await read(source, shard) == store.data[key]

    settings = dataclasses.replace(FAST, s3_endpoint=store.moto.url, s3_addressing="path")
    config = write(tmp_path / "config", (
        f"[profile base]\naws_access_key_id = {store.assumer.access_key}\n"
        f"aws_secret_access_key = {store.assumer.secret_key}\n\n"
        f"[profile job]\nrole_arn = {role_arn}\nsource_profile = base\n"))
    aws_only(monkeypatch, tmp_path, AWS_CONFIG_FILE=config, AWS_PROFILE="job",
             AWS_ENDPOINT_URL_STS=store.moto.url, AWS_REGION="us-east-1")
    source = S3Source(settings)
    run(source, reads)
    assert source.credential_method == "assume-role"
    assert source._signing is not None and source._signing.session_token
    # An STS that refuses: a clear error naming the route, not a traceback.
    write(tmp_path / "config", (
        f"[profile base]\naws_access_key_id = {store.assumer.access_key}\n"
        "aws_secret_access_key = wrong\n\n"
        f"[profile job]\nrole_arn = {role_arn}\nsource_profile = base\n"))
    source = S3Source(settings)

    async def refused(source: S3Source) -> None:
        with pytest.raises(SourceError, match=r"cannot obtain AWS credentials.*AssumeRole"):
            await source.stat(url(key))

    run(source, refused)
