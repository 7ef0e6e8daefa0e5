"""Every AWS credential route, against a real S3 server (SeaweedFS, which checks SigV4).

The routes are botocore's (shardfs/sources/credentials.py); the endpoints credentials come
from (IMDSv2, container credentials, STS web identity, the SSO portal) are loopback stand-ins
(tests/cloud_standins.py); token files, credential_process scripts and AWS config files are
real files. Refresh during a read and forced refresh on a rotated key go through a gate that
refuses expired keys as S3 does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from shardfs.sources import S3Source, ShardInfo, SourceError, SourceSettings
from tests.cloud_standins import (
    Answer,
    Request,
    Vendor,
    container_route,
    gate_route,
    imds_route,
    serve,
    sso_route,
    sts_route,
)
from tests.conftest import SHARDFS, Dataset, Mounter
from tests.seaweed_fixture import SeaweedServer

BUCKET = "shards"
KEYS = [(f"SWKEY{i:011d}", f"sw-secret-{i}") for i in range(6)]
STATIC = ("SWSTATIC00000000", "sw-static-secret")
SIZES = {"a/train-0.tar": 700_001, "a/train-1.tar": 65_537}
FAST = SourceSettings(timeout=5.0, deadline=20.0, backoff_initial=0.02, backoff_max=0.3,
                      chunk_size=64 * 1024)


@dataclass
class Weed:
    server: SeaweedServer
    data: dict[str, bytes]


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    identities = {f"user{i}": (k, s, ["Read", "List"]) for i, (k, s) in enumerate(KEYS)}
    identities["static"] = (*STATIC, ["Read", "List"])
    with SeaweedServer(tmp_path_factory.mktemp("weed"), identities) as server:
        server.admin.create_bucket(Bucket=BUCKET)
        data = {}
        for key, size in SIZES.items():
            data[key] = random.Random(key).randbytes(size)
            server.admin.put_object(Bucket=BUCKET, Key=key, Body=data[key])
        yield Weed(server, data)


@pytest.fixture
def aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AWS settings of the machine or the user leak in; IMDS off unless a test sets it."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def settings_for(weed: Weed, **kw: object) -> SourceSettings:
    return dataclasses.replace(FAST, s3_endpoint=weed.server.url, s3_addressing="path",
                               s3_region="us-east-1", **kw)


async def read(source: S3Source, shard: ShardInfo, start: int = 0, end: int | None = None
               ) -> bytes:
    parts = []
    async with aclosing(source.stream(shard, start, shard.size if end is None else end)) as it:
        async for chunk in it:
            parts.append(chunk)
    return b"".join(parts)


def read_everything(weed: Weed, settings: SourceSettings) -> S3Source:
    """Stat and read every shard byte-exactly; return the (closed) source for inspection."""
    source = S3Source(settings)

    async def main() -> None:
        try:
            for key, body in weed.data.items():
                shard = await source.stat(f"s3://{BUCKET}/{key}")
                assert await read(source, shard) == body
        finally:
            await source.aclose()

    trio.run(main)
    return source


# -- each route ----------------------------------------------------------------------------------


def test_environment_and_shared_files(weed: Weed, aws_env: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    # Environment variables.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", STATIC[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", STATIC[1])
    with caplog.at_level(logging.INFO, logger="shardfs.sources.credentials"):
        source = read_everything(weed, settings_for(weed))
    assert source.credential_method == "env"
    assert "environment variables [env]" in caplog.text and STATIC[0] in caplog.text
    assert STATIC[1] not in caplog.text  # the secret is never logged
    # A named profile in the shared credentials file (AWS_PROFILE skips the environment).
    (aws_env / "credentials").write_text(
        f"[train]\naws_access_key_id = {KEYS[0][0]}\naws_secret_access_key = {KEYS[0][1]}\n")
    monkeypatch.setenv("AWS_PROFILE", "train")
    assert read_everything(weed, settings_for(weed)).credential_method == \
        "shared-credentials-file"
    # Partial environment credentials are an error that says so, not anonymous requests.
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(SourceError, match=r"(?i)cannot obtain AWS credentials.*partial"):
        read_everything(weed, settings_for(weed))


def test_credential_process(weed: Weed, aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = aws_env / "creds.py"
    runs = aws_env / "runs"
    script.write_text(
        "import json, sys, datetime\n"
        f"open({str(runs)!r}, 'a').write('x')\n"
        "exp = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {KEYS[1][0]!r}, "
        f"'SecretAccessKey': {KEYS[1][1]!r}, 'Expiration': exp.isoformat()}}))\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    (aws_env / "config").write_text(
        f"[profile proc]\ncredential_process = {sys.executable} {script}\n")
    monkeypatch.setenv("AWS_PROFILE", "proc")
    source = read_everything(weed, settings_for(weed))
    assert source.credential_method == "custom-process"
    assert runs.read_text() == "x"  # run once, not per request
    # A failing process is a clear error.
    (aws_env / "config").write_text(
        f"[profile proc]\ncredential_process = {sys.executable} -c 'import sys; sys.exit(3)'\n")
    with pytest.raises(SourceError, match="cannot obtain AWS credentials"):
        read_everything(weed, settings_for(weed))


def test_container_credentials(weed: Weed, aws_env: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    vendor = Vendor([KEYS[2]])
    token_file = aws_env / "pod-identity-token"
    token_file.write_text("eks-pod-identity-token-1")
    with serve(container_route(vendor, "/v1/credentials", "eks-pod-identity-token-1")) as ep:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/v1/credentials")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
        source = read_everything(weed, settings_for(weed))
        assert source.credential_method == "container-role"
        assert [r.headers["authorization"] for r in ep.seen] == ["eks-pod-identity-token-1"]
        # A wrong token is refused by the endpoint: no credentials, a clear error.
        token_file.write_text("stale")
        with pytest.raises(SourceError, match="cannot obtain AWS credentials"):
            read_everything(weed, settings_for(weed))


def test_instance_metadata_v2(weed: Weed, aws_env: Path, monkeypatch: pytest.MonkeyPatch
                              ) -> None:
    vendor = Vendor([KEYS[3]])
    with serve(imds_route(vendor)) as imds:
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url + "/")
        source = read_everything(weed, settings_for(weed))
        assert source.credential_method == "iam-role"
        first = imds.seen[0]
        assert (first.method, first.path) == ("PUT", "/latest/api/token")
        assert all("x-aws-ec2-metadata-token" in r.headers for r in imds.seen[1:])
        assert vendor.issued and vendor.issued[0][0] == KEYS[3][0]


def test_web_identity(weed: Weed, aws_env: Path, monkeypatch: pytest.MonkeyPatch,
                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # as with --log-level debug
    vendor = Vendor([KEYS[4]])
    seen_tokens: list[str] = []
    token_file = aws_env / "irsa-token"
    token_file.write_text("eyJhbGciOi.projected-service-account-token.sig")
    with serve(sts_route(vendor, seen_tokens)) as sts:
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/trainer")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.url)
        source = read_everything(weed, settings_for(weed))
        assert source.credential_method == "assume-role-with-web-identity"
        assert seen_tokens == ["eyJhbGciOi.projected-service-account-token.sig"]
    # botocore's debug log would print the token and the STS answer: kept at info.
    assert "assume-role-with-web-identity" in caplog.text
    assert "projected-service-account-token" not in caplog.text
    assert KEYS[4][1] not in caplog.text


def test_sso_cached_token(weed: Weed, aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`aws sso login` leaves a cached token; botocore trades it at the portal for role
    credentials. The portal is a stand-in; the login itself (a browser flow) is not tested."""
    vendor = Vendor([KEYS[5]])
    start_url = "https://example.awsapps.com/start"
    cache = aws_env / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
    (cache / (hashlib.sha1(start_url.encode()).hexdigest() + ".json")).write_text(json.dumps(
        {"startUrl": start_url, "region": "us-east-1", "accessToken": "sso-access-token",
         "expiresAt": expires}))
    (aws_env / "config").write_text(
        f"[profile sso]\nsso_start_url = {start_url}\nsso_region = us-east-1\n"
        "sso_account_id = 123456789012\nsso_role_name = Trainer\n")
    # botocore fixes the cache directory from HOME when it is first imported (earlier in
    # this session, with the real HOME), so point it at this test's HOME.
    monkeypatch.setattr("botocore.credentials.SSOProvider._SSO_TOKEN_CACHE_DIR", str(cache))
    with serve(sso_route(vendor, "sso-access-token")) as portal:
        monkeypatch.setenv("AWS_PROFILE", "sso")
        monkeypatch.setenv("AWS_ENDPOINT_URL_SSO", portal.url)
        source = read_everything(weed, settings_for(weed))
        assert source.credential_method == "sso"
        assert portal.seen[0].query == {"role_name": "Trainer", "account_id": "123456789012"}


# -- refresh -------------------------------------------------------------------------------------


def test_refresh_during_a_long_read(weed: Weed, aws_env: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials living 6 s, a read lasting several lifetimes: every request is signed with
    an unexpired key (the gate refuses expired ones as S3 does), refreshes happen ahead of
    expiry in the background, and the bytes are exact."""
    vendor = Vendor(KEYS[:3], lifetime=6.0)
    gate_log: list[str] = []
    with serve(container_route(vendor, "/creds", "tok")) as ep, \
            serve(gate_route(vendor, weed.server.url, gate_log)) as gate:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "tok")
        settings = dataclasses.replace(settings_for(weed), s3_endpoint=gate.url,
                                       chunk_size=4096)
        source = S3Source(settings)
        key = "a/train-0.tar"

        async def main() -> None:
            try:
                shard = await source.stat(f"s3://{BUCKET}/{key}")
                got = bytearray()
                end = time.monotonic() + 15.0
                while time.monotonic() < end:  # many small reads over ~2.5 lifetimes
                    start = random.randrange(0, shard.size - 5000)
                    got = bytearray(await read(source, shard, start, start + 5000))
                    assert bytes(got) == weed.data[key][start:start + 5000]
                    await trio.sleep(0.05)
            finally:
                await source.aclose()

        trio.run(main)
    assert len(vendor.issued) >= 3  # refreshed at least twice during the read
    # One fetch per refresh (botocore's own 15-minute window would fetch twice each time).
    assert source.stats.credential_refreshes == len(vendor.issued) - 1
    assert all(gate_log)  # every request was signed
    # Nothing was refused: every request carried a key that was valid when it was sent.
    assert source.stats.by_status.get(400, 0) == 0 and source.stats.by_status.get(403, 0) == 0


def test_rotated_key_refreshes_once_and_retries(weed: Weed, aws_env: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    vendor = Vendor([KEYS[0], KEYS[1]], lifetime=3600.0)
    vendor.revoked.add(KEYS[0][0])  # the first key handed out was rotated away already
    gate_log: list[str] = []
    with serve(container_route(vendor, "/creds", "tok")) as ep, \
            serve(gate_route(vendor, weed.server.url, gate_log)) as gate:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "tok")
        settings = dataclasses.replace(settings_for(weed), s3_endpoint=gate.url)
        source = read_everything(weed, settings)
        assert gate_log[0] == KEYS[0][0] and gate_log[1] == KEYS[1][0]
        assert source.stats.credential_refreshes == 1 and len(vendor.issued) == 2
        # Every key refused: exactly one refresh per refusal, then the error names the key
        # and the provider (never the secret).
        vendor.revoked.update({KEYS[0][0], KEYS[1][0]})
        vendor.issued.clear()
        with pytest.raises(SourceError, match="does not know access key") as info:
            read_everything(weed, settings)
        assert "container credentials" in str(info.value)
        assert KEYS[0][1] not in str(info.value) and KEYS[1][1] not in str(info.value)
        assert len(vendor.issued) == 2


def test_expiry_and_refresh_during_a_mount(weed: Weed, aws_env: Path, dataset: Dataset,
                                           mounter: Mounter,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A real mount signing with container credentials that live 5 s: it stays idle past
    two lifetimes, then every file reads back exactly; no request was refused as expired,
    the stats name the provider and count the refreshes, the log names the provider and
    never the secret."""
    for path in sorted(dataset.shard_dir.iterdir()):  # shards and index files
        weed.server.admin.upload_file(str(path), BUCKET, f"mnt/{path.name}")
    vendor = Vendor(KEYS[3:6], lifetime=5.0)
    gate_log: list[str] = []
    with serve(container_route(vendor, "/creds", "pod-token")) as ep, \
            serve(gate_route(vendor, weed.server.url, gate_log)) as gate:
        token_file = aws_env / "token"
        token_file.write_text("pod-token")
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
        m = mounter.mount([f"s3://{BUCKET}/mnt/"], None, None, "--s3-endpoint", gate.url,
                          "--s3-addressing", "path", "--s3-region", "us-east-1", "--no-warm",
                          "--request-rate", "500")
        time.sleep(11.0)  # past two lifetimes of the credentials the mount started with
        for rel, body in dataset.files().items():
            assert (m.mountpoint / rel).read_bytes() == body
        stats = m.stats()
        source = stats["source"]
        assert source["credential_providers"] == {"s3": "container-role"}
        assert source["credential_refreshes"] >= 1
        assert not {"400", "403"} & set(source["by_status"])  # no expired key was sent
        assert stats["reader"]["eio"] == 0
        shown = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                               text=True, timeout=30)
        assert "credentials     s3: container-role" in shown.stdout, shown.stdout + shown.stderr
        log = m.log()
        assert "container credentials (ECS / EKS Pod Identity) [container-role]" in log
        assert all(secret not in log for _, secret in KEYS)
        m.unmount()
    assert len(vendor.issued) >= 2


def test_reads_go_on_during_a_background_refresh(weed: Weed, aws_env: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The credential endpoint takes 1.5 s to answer a refresh: reads keep completing with
    the current credentials meanwhile (the refresh starts well before the blocking point)."""
    vendor = Vendor(KEYS[:2], lifetime=8.0)
    route = container_route(vendor, "/creds", "tok")
    windows: list[tuple[float, float]] = []

    def slow(req: Request) -> Answer:
        if not vendor.issued:
            return route(req)
        start = time.time()
        time.sleep(1.5)
        answer = route(req)
        windows.append((start, time.time()))
        return answer

    with serve(slow) as ep:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "tok")
        source = S3Source(settings_for(weed))
        key = "a/train-1.tar"
        done: list[float] = []

        async def main() -> None:
            try:
                shard = await source.stat(f"s3://{BUCKET}/{key}")
                end = time.time() + 7.0
                while time.time() < end and not windows:
                    start = random.randrange(0, shard.size - 1000)
                    assert await read(source, shard, start, start + 1000) == \
                        weed.data[key][start:start + 1000]
                    done.append(time.time())
                    await trio.sleep(0.02)
            finally:
                await source.aclose()

        trio.run(main)
    assert windows, "no refresh happened within the credentials' lifetime"
    begin, finish = windows[0]
    assert sum(begin < t < finish for t in done) >= 5
