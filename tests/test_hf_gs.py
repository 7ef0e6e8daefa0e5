"""hf:// and gs:// against loopback stand-ins of the Hugging Face Hub and Google Cloud Storage.

The stand-ins behave like the real services on what shardfs relies on:
- Hub: `/datasets/ORG/NAME/resolve/REV/PATH` answers 302 to a separate file store (another
  origin) with a signed, expiring URL; gated repositories answer 401/403 with X-Error-Code;
  missing files 404 EntryNotFound. The file store serves Range with its own ETag and refuses
  any Authorization header (as presigned object-store URLs do).
- GCS: the XML API (`/BUCKET/KEY` with Range, ETag, If-Match; ListObjectsV2) accepting only
  unexpired OAuth bearer tokens (401 otherwise); tokens come from a metadata-server stand-in
  (`Metadata-Flavor: Google`), an OAuth token endpoint (a user's refresh_token grant; a
  service account's JWT bearer grant, whose RS256 signature it verifies with the account's
  public key) or an STS token exchange (workload identity federation).
gs:// with HMAC keys is S3 itself and runs against SeaweedFS (a real S3 server).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import trio

from shardfs.catalog.resolve import resolve_sources
from shardfs.sources import NotFound, ShardChanged, ShardInfo, SourceError, Sources, SourceSettings
from shardfs.sources.gs import GsSource
from shardfs.sources.hf import HfSource, hf_to_https
from tests.cloud_standins import Answer, Request, serve
from tests.conftest import Dataset, Mounter, brace

FAST = SourceSettings(timeout=5.0, deadline=15.0, backoff_initial=0.02, backoff_max=0.3,
                      chunk_size=32 * 1024)
FILES = {f"train/shard-{i}.tar": random.Random(i).randbytes(150_000 + i) for i in range(3)}
SIGNING = b"file-store-signing-key"


def ranged(body: bytes, req: Request, etag: str) -> Answer:
    """A 200/206 answer honouring Range and If-Match, as S3 / CDNs do."""
    if "if-match" in req.headers and req.headers["if-match"] != etag:
        return 412, {}, b""
    spec = req.headers.get("range")
    if not spec:
        return 200, {"ETag": etag, "Accept-Ranges": "bytes"}, body
    first, _, last = spec.removeprefix("bytes=").partition("-")
    start, end = int(first), min(int(last) if last else len(body) - 1, len(body) - 1)
    if start >= len(body):
        return 416, {"Content-Range": f"bytes */{len(body)}"}, b""
    return 206, {"ETag": etag, "Content-Range": f"bytes {start}-{end}/{len(body)}"}, \
        body[start:end + 1]


# -- Hugging Face ----------------------------------------------------------------------------


class Hub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {
            "datasets/org/public@main": dict(FILES),
            "datasets/org/public@v1.0": {"train/shard-0.tar": b"old" * 1000},
            "datasets/org/gated@main": dict(FILES),
        }
        self.token = "hf_goodtoken"
        self.store_url = ""

    def hub(self, req: Request) -> Answer:
        parts = unquote(urlsplit(req.path).path).lstrip("/").split("/")
        # datasets/ORG/NAME/resolve/REV/PATH... (REV came percent-encoded; unquoted here)
        if len(parts) < 6 or parts[3] != "resolve":
            return 404, {"X-Error-Code": "RepoNotFound"}, b""
        repo = f"{parts[0]}/{parts[1]}/{parts[2]}"
        rev, path = parts[4], "/".join(parts[5:])
        if repo.endswith("gated"):
            auth = req.headers.get("authorization")
            if auth is None:
                return 401, {"X-Error-Code": "GatedRepo"}, b"gated"
            if auth != f"Bearer {self.token}":
                return 403, {"X-Error-Code": "GatedRepo"}, b"not accepted"
        files = self.repos.get(f"{repo}@{rev}")
        if files is None:
            return 404, {"X-Error-Code": "RevisionNotFound"}, b""
        if path not in files:
            return 404, {"X-Error-Code": "EntryNotFound"}, b""
        sha = hashlib.sha256(files[path]).hexdigest()
        expires = str(int(time.time()) + 3600)
        sig = hmac.new(SIGNING, f"{sha}:{expires}".encode(), "sha256").hexdigest()
        return 302, {"Location": f"{self.store_url}/blobs/{sha}?Expires={expires}&sig={sig}",
                     "X-Linked-Etag": f'"{sha}"', "ETag": '"hub-own-etag"',
                     "X-Linked-Size": str(len(files[path]))}, b""

    def store(self, req: Request) -> Answer:
        if "authorization" in req.headers:
            return 400, {}, b"<Error><Code>InvalidArgument</Code><Message>Only one auth " \
                b"mechanism allowed</Message></Error>"
        url = urlsplit(req.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        sha = url.path.rsplit("/", 1)[-1]
        good = hmac.new(SIGNING, f"{sha}:{query.get('Expires')}".encode(), "sha256").hexdigest()
        if query.get("sig") != good or int(query.get("Expires", 0)) < time.time():
            return 403, {}, b"<Error><Code>AccessDenied</Code></Error>"
        for files in self.repos.values():
            for body in files.values():
                if hashlib.sha256(body).hexdigest() == sha:
                    return ranged(body, req, f'"store-{sha[:16]}"')
        return 404, {}, b""


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Hub, object, object]]:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    state = Hub()
    with serve(state.hub) as hub_server, serve(state.store) as store_server:
        state.store_url = store_server.url
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        yield state, hub_server, store_server


async def read(source: object, shard: ShardInfo, start: int = 0, end: int | None = None
               ) -> bytes:
    parts = []
    stream = source.stream(shard, start, shard.size if end is None else end)  # type: ignore
    async with aclosing(stream) as chunks:
        async for chunk in chunks:
            parts.append(chunk)
    return b"".join(parts)


def test_hf_url_mapping() -> None:
    e = "https://huggingface.co"
    assert hf_to_https("hf://datasets/org/name/train/a b.tar", e) == \
        f"{e}/datasets/org/name/resolve/main/train/a%20b.tar"
    assert hf_to_https("hf://datasets/org/name@refs%2Fconvert%2Fparquet/x.tar", e) == \
        f"{e}/datasets/org/name/resolve/refs%2Fconvert%2Fparquet/x.tar"
    assert hf_to_https("hf://org/model@v2/w.tar", e) == f"{e}/org/model/resolve/v2/w.tar"
    assert hf_to_https("hf://spaces/o/s/f.tar", e) == f"{e}/spaces/o/s/resolve/main/f.tar"
    with pytest.raises(SourceError, match="expected hf://datasets/ORG/NAME"):
        hf_to_https("hf://datasets/org/name", e)


def test_hf_public_dataset_through_redirects(hub: tuple[Hub, object, object],
                                            caplog: pytest.LogCaptureFixture) -> None:
    state, hub_server, store_server = hub
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        sources = Sources(FAST)
        try:
            urls = await resolve_sources(
                ["hf://datasets/org/public/train/shard-{0..2}.tar"], sources)
            assert urls == [f"hf://datasets/org/public/train/shard-{i}.tar" for i in range(3)]
            source = sources.for_url(urls[0])
            assert isinstance(source, HfSource)
            for url, (_, body) in zip(urls, FILES.items(), strict=True):
                shard = await source.stat(url)
                assert shard.size == len(body) and shard.etag.startswith('"store-')
                assert await read(source, shard) == body
                assert await read(source, shard, 1000, 70_001) == body[1000:70_001]
            # A revision; a missing file; a missing sidecar index is simply absent.
            old = await source.stat("hf://datasets/org/public@v1.0/train/shard-0.tar")
            assert await read(source, old) == b"old" * 1000
            with pytest.raises(NotFound, match="no such file in the repository"):
                await source.stat("hf://datasets/org/public/train/nope.tar")
            assert await source.fetch_optional(urls[0] + ".shardfs.idx") is None
            # The file changes on the Hub: detected by the store's ETag and size.
            shard = await source.stat(urls[1])
            state.repos["datasets/org/public@main"]["train/shard-1.tar"] = b"new" * 50_001
            with pytest.raises(ShardChanged):
                await read(source, shard)
            assert sources.stats().credential_providers == {"hf": "anonymous"}
        finally:
            await sources.aclose()

    trio.run(main)
    assert all("authorization" not in r.headers for r in hub_server.seen)  # type: ignore
    assert all("if-match" not in r.headers for r in hub_server.seen)  # type: ignore
    # The file store's signed URLs are capabilities: httpx's request log shows no query.
    assert "/blobs/" in caplog.text and "sig=" not in caplog.text
    assert all("range" in r.headers for r in store_server.seen)  # type: ignore


def test_hf_gated_dataset_needs_the_token(hub: tuple[Hub, object, object], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    state, hub_server, store_server = hub
    url = "hf://datasets/org/gated/train/shard-2.tar"

    async def stat() -> ShardInfo:
        source = HfSource(FAST)
        try:
            shard = await source.stat(url)
            assert await read(source, shard) == FILES["train/shard-2.tar"]
            return shard
        finally:
            await source.aclose()

    with pytest.raises(SourceError, match=r"gated.*set HF_TOKEN or run `huggingface-cli login`"):
        trio.run(stat)
    monkeypatch.setenv("HF_TOKEN", "hf_wrongtoken")
    with pytest.raises(SourceError, match=r"gated.*the token was refused") as info:
        trio.run(stat)
    assert "hf_wrongtoken" not in str(info.value)
    # The token file `huggingface-cli login` writes.
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(state.token + "\n")
    trio.run(stat)
    assert hub_server.seen[-1].headers["authorization"] == f"Bearer {state.token}"  # type: ignore
    # The token goes to the Hub only, never to the file store (which would refuse it).
    assert all("authorization" not in r.headers for r in store_server.seen)  # type: ignore


# -- Google Cloud Storage ------------------------------------------------------------------------


def b64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Gcs:
    """The XML API, a metadata server, an OAuth token endpoint and an STS, sharing issued
    tokens. `service_account`: (client email, public key) whose signed JWTs it honours;
    `subject_token`: the external token its STS exchanges."""

    def __init__(self, lifetime: float = 3600.0,
                 service_account: tuple[str, object] | None = None,
                 subject_token: str | None = None) -> None:
        self.lifetime = lifetime
        self.service_account = service_account
        self.subject_token = subject_token
        self.grants: list[str] = []  # grant types of the tokens issued at /token and /sts
        self.exchanged: list[tuple[str, str]] = []  # (audience, subject token) at /sts
        self.tokens: dict[str, float] = {}  # token -> expiry
        self.objects = {f"b1/{k}": v for k, v in FILES.items()}
        self.refused = 0
        self._lock = threading.Lock()

    def issue(self) -> dict:
        with self._lock:
            token = f"ya29.token-{len(self.tokens)}"
            self.tokens[token] = time.time() + self.lifetime
        return {"access_token": token, "expires_in": int(self.lifetime),
                "token_type": "Bearer"}

    def route(self, req: Request) -> Answer:
        url = urlsplit(req.path)
        if url.path == "/computeMetadata/v1/instance/service-accounts/default/token":
            if req.headers.get("metadata-flavor") != "Google":
                return 403, {}, b"Missing Metadata-Flavor:Google header."
            return 200, {"Content-Type": "application/json"}, json.dumps(self.issue()).encode()
        if url.path in ("/token", "/sts") and req.method == "POST":
            form = {k: v[0] for k, v in parse_qs(req.body.decode()).items()}
            if url.path == "/sts":
                self.exchanged.append((form.get("audience", ""), form.get("subject_token", "")))
            granted = self._grant(url.path, form)
            if not granted:
                return 400, {"Content-Type": "application/json"}, b'{"error":"invalid_grant"}'
            self.grants.append(form["grant_type"])
            answer = self.issue()
            if url.path == "/sts":
                answer["issued_token_type"] = "urn:ietf:params:oauth:token-type:access_token"
            return 200, {"Content-Type": "application/json"}, json.dumps(answer).encode()
        auth = req.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ")
        if not auth.startswith("Bearer ") or self.tokens.get(token, 0) <= time.time():
            self.refused += 1
            return 401, {"Content-Type": "application/xml"}, (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AuthenticationRequired"
                b"</Code><Message>Authentication required.</Message></Error>")
        bucket, _, key = url.path.lstrip("/").partition("/")
        if not key:  # a listing
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            prefix = query.get("prefix", "")
            keys = sorted(k.partition("/")[2] for k in self.objects
                          if k.startswith(f"{bucket}/{prefix}"))
            body = "".join(f"<Contents><Key>{k}</Key></Contents>" for k in keys)
            return 200, {"Content-Type": "application/xml"}, (
                "<?xml version='1.0' encoding='UTF-8'?><ListBucketResult xmlns="
                f"'http://doc.s3.amazonaws.com/2006-03-01'><Name>{bucket}</Name>{body}"
                "<IsTruncated>false</IsTruncated></ListBucketResult>").encode()
        body = self.objects.get(f"{bucket}/{unquote(key)}")
        if body is None:
            return 404, {"Content-Type": "application/xml"}, \
                b"<Error><Code>NoSuchKey</Code></Error>"
        return ranged(body, req, f'"{hashlib.md5(body).hexdigest()}"')


    def _grant(self, path: str, form: dict[str, str]) -> bool:
        grant = form.get("grant_type")
        if path == "/sts":  # RFC 8693, as Google's STS takes it
            return grant == "urn:ietf:params:oauth:grant-type:token-exchange" and \
                self.subject_token is not None and \
                form.get("subject_token") == self.subject_token and \
                form.get("requested_token_type") == \
                "urn:ietf:params:oauth:token-type:access_token"
        if grant == "refresh_token":
            return form.get("refresh_token") == "1//rt"
        if grant == "urn:ietf:params:oauth:grant-type:jwt-bearer" and self.service_account:
            return self._valid_jwt(form.get("assertion", ""))
        return False

    def _valid_jwt(self, assertion: str) -> bool:
        """A service account's assertion: signed RS256 by its key, for this endpoint, asking
        for read-only storage, unexpired."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        assert self.service_account is not None
        email, public_key = self.service_account
        try:
            head, body, signature = assertion.split(".")
            public_key.verify(b64url(signature), f"{head}.{body}".encode(),  # type: ignore
                              padding.PKCS1v15(), hashes.SHA256())
        except (ValueError, InvalidSignature):
            return False
        claims = json.loads(b64url(body))
        return json.loads(b64url(head)).get("alg") == "RS256" and \
            claims.get("iss") == email and claims.get("aud", "").endswith("/token") and \
            claims.get("scope") == "https://www.googleapis.com/auth/devstorage.read_only" and \
            claims.get("exp", 0) > time.time()


@pytest.fixture
def gcs_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("GS_ACCESS_KEY_ID", "GS_SECRET_ACCESS_KEY", "GOOGLE_OAUTH_ACCESS_TOKEN",
                 "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_HOST",
                 "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_gs_metadata_token_refreshed_during_reads(gcs_env: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gcs = Gcs(lifetime=4.0)
    with serve(gcs.route) as server:
        monkeypatch.setenv("GCE_METADATA_HOST", server.url.removeprefix("http://"))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        async def main() -> None:
            sources = Sources(FAST)
            try:
                urls = await resolve_sources(["gs://b1/train/"], sources)
                assert urls == [f"gs://b1/{k}" for k in sorted(FILES)]
                source = sources.for_url(urls[0])
                assert isinstance(source, GsSource)
                shard = await source.stat(urls[0])
                body = FILES["train/shard-0.tar"]
                end = time.monotonic() + 9.0  # over two token lifetimes
                while time.monotonic() < end:
                    start = random.randrange(0, shard.size - 3000)
                    assert await read(source, shard, start, start + 3000) == \
                        body[start:start + 3000]
                    await trio.sleep(0.05)
                stats = sources.stats()
                assert stats.credential_refreshes >= 2
                assert stats.credential_providers["gs"].startswith("the metadata server")
            finally:
                await sources.aclose()

        trio.run(main)
    assert len(gcs.tokens) >= 3 and gcs.refused == 0  # refreshed ahead of expiry


def test_gs_user_credentials_and_forced_refresh(gcs_env: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gcs = Gcs()
    with serve(gcs.route) as server:
        adc = gcs_env / ".config" / "gcloud" / "application_default_credentials.json"
        adc.parent.mkdir(parents=True)
        adc.write_text(json.dumps({"type": "authorized_user", "client_id": "cid",
                                   "client_secret": "csecret", "refresh_token": "1//rt",
                                   "token_uri": server.url + "/token"}))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        async def main() -> None:
            source = GsSource(FAST)
            try:
                shard = await source.stat("gs://b1/train/shard-1.tar")
                gcs.tokens.clear()  # revoked: the next request gets 401, refresh, retry
                assert await read(source, shard) == FILES["train/shard-1.tar"]
                assert source.stats.credential_refreshes == 1
                assert "user credentials from" in (source.credential_method or "")
            finally:
                await source.aclose()

        trio.run(main)
        assert gcs.refused == 1


def test_gs_service_account_key(gcs_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service-account key file (GOOGLE_APPLICATION_CREDENTIALS): google-auth signs a JWT
    with its private key (RS256), the token endpoint checks the signature with the public key
    and issues a token scoped to read-only storage; it is refreshed ahead of expiry. A key
    the endpoint does not know, or a file that holds no key, is a clear error."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    email = "reader@proj.iam.gserviceaccount.com"
    gcs = Gcs(lifetime=4.0, service_account=(email, key.public_key()))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    with serve(gcs.route) as server:
        key_file = gcs_env / "sa.json"
        document = {"type": "service_account", "project_id": "proj", "private_key_id": "k1",
                    "private_key": pem, "client_email": email, "client_id": "1",
                    "token_uri": server.url + "/token"}
        key_file.write_text(json.dumps(document))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        async def main() -> None:
            source = GsSource(FAST)
            try:
                shard = await source.stat("gs://b1/train/shard-2.tar")
                end = time.monotonic() + 5.0  # over a token's lifetime
                while time.monotonic() < end:
                    assert await read(source, shard) == FILES["train/shard-2.tar"]
                    await trio.sleep(0.2)
                assert source.stats.credential_refreshes >= 1
                assert source.credential_method == \
                    f"service account {email} (key from {key_file})"
            finally:
                await source.aclose()

        trio.run(main)
        assert gcs.refused == 0
        assert gcs.grants and set(gcs.grants) == {"urn:ietf:params:oauth:grant-type:jwt-bearer"}
        assert pem not in json.dumps(gcs.grants)

        other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        unknown = {**document, "private_key": other.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode()}
        for bad, words in ((unknown, "invalid_grant"), ({**document, "private_key": "-----"},
                                                         "type 'service_account'")):
            key_file.write_text(json.dumps(bad))

            async def refused(words: str = words) -> None:
                source = GsSource(FAST)
                try:
                    with pytest.raises(SourceError, match=words) as raised:
                        await source.stat("gs://b1/train/shard-1.tar")
                    assert "BEGIN PRIVATE KEY" not in str(raised.value)
                finally:
                    await source.aclose()

            trio.run(refused)


def test_gs_workload_identity_federation(gcs_env: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An `external_account` file (workload identity federation, as `gcloud iam
    workload-identity-pools create-cred-config` writes it): google-auth reads the external
    token from its credential source (a file here: a Kubernetes service-account token, say)
    and exchanges it at the STS for an access token."""
    gcs = Gcs(subject_token="eyJ.external-oidc-token.sig")
    with serve(gcs.route) as server:
        subject = gcs_env / "oidc-token"
        subject.write_text(gcs.subject_token or "")
        audience = ("//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/"
                    "pool/providers/cluster")
        config = gcs_env / "wif.json"
        config.write_text(json.dumps({
            "type": "external_account", "audience": audience,
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": server.url + "/sts", "credential_source": {"file": str(subject)}}))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(config))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)

        async def main() -> None:
            source = GsSource(FAST)
            try:
                shard = await source.stat("gs://b1/train/shard-0.tar")
                assert await read(source, shard) == FILES["train/shard-0.tar"]
                assert source.credential_method == \
                    f"workload identity federation ({audience}) from {config}"
            finally:
                await source.aclose()

        trio.run(main)
        assert gcs.grants == ["urn:ietf:params:oauth:grant-type:token-exchange"]


def test_gs_hmac_keys_against_a_real_s3_server(gcs_env: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """GCS's HMAC interoperability is SigV4 over the XML API: checked by SeaweedFS."""
    from tests.seaweed_fixture import SeaweedServer

    key, secret = "GOOGHMACKEY00000", "gcs-hmac-secret"
    with SeaweedServer(tmp_path / "weed", {"gcs": (key, secret, ["Read", "List"])}) as weed:
        weed.admin.create_bucket(Bucket="gbucket")
        weed.admin.put_object(Bucket="gbucket", Key="s/shard-0.tar", Body=FILES[
            "train/shard-0.tar"])
        monkeypatch.setenv("GS_ACCESS_KEY_ID", key)
        monkeypatch.setenv("GS_SECRET_ACCESS_KEY", secret)
        settings = dataclasses.replace(FAST, gs_endpoint=weed.url)

        async def main() -> None:
            source = GsSource(settings)
            try:
                shard = await source.stat("gs://gbucket/s/shard-0.tar")
                assert await read(source, shard) == FILES["train/shard-0.tar"]
                listing = await source.list_prefix("gs://gbucket/s/")
                assert listing.urls == ["gs://gbucket/s/shard-0.tar"]
                assert source.credential_method == "gcs-hmac"
            finally:
                await source.aclose()

        trio.run(main)
    assert os.environ["GS_ACCESS_KEY_ID"] == key


def test_hf_gated_dataset_mounted(hub: tuple[Hub, object, object], dataset: Dataset,
                                  mounter: Mounter, tmp_path: Path) -> None:
    """A real FUSE mount of a gated Hub dataset named by a brace pattern, with the token of
    `huggingface-cli login`: every file reads back exactly; the token is not in the log."""
    state, _, store_server = hub
    state.repos["datasets/org/gated@main"] = {
        f"wds/{p.name}": p.read_bytes() for p in dataset.shard_dir.iterdir()}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(state.token)
    m = mounter.mount([brace(dataset, "hf://datasets/org/gated/wds")])
    for rel, body in dataset.files().items():
        assert (m.mountpoint / rel).read_bytes() == body
    stats = m.stats()
    assert stats["source"]["credential_providers"] == {"hf": "hf-token"}
    assert stats["reader"]["eio"] == 0
    assert state.token not in m.log()
    assert all("authorization" not in r.headers for r in store_server.seen)  # type: ignore
    m.unmount()
