"""Documented behaviours that no test guarded until each was broken on purpose (issue 30).

Each test here fails under the smallest change that breaks its behaviour; docs/testing.md's map
names that change. Real parts: mounts through the CLI, loopback servers, moto's S3 (which
checks session tokens), a second FUSE filesystem (tests/otherfs.py).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trio

from shardfs.daemon.mountpoint import mounted_fstype
from shardfs.fuse import pagepush
from shardfs.sources import HttpSource, ShardChanged, ShardInfo, SourceSettings
from tests.cloud_standins import (
    Answer,
    Request,
    Served,
    Vendor,
    container_route,
    imds_route,
    serve,
    sts_route,
)
from tests.conftest import SHARDFS, Dataset, Mount, Mounter, brace, needs_shim, shard_names
from tests.moto_fixture import MotoServer
from tests.test_hf_gs import ranged

FAST = SourceSettings(timeout=5.0, deadline=10.0, backoff_initial=0.02, backoff_max=0.3,
                      chunk_size=32 * 1024)


def shardfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*SHARDFS, *args], capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def etag_of(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:20] + '"'


class Files:
    """A loopback HTTP server over a dict of files: Range, HEAD and an ETag per version.
    `if_match`: honour If-Match (412 on a stale one, as nginx and S3 do) or ignore it, as the
    Hugging Face Hub's file store and some CDNs do."""

    def __init__(self, files: dict[str, bytes], *, if_match: bool):
        self.files = files
        self.if_match = if_match

    def route(self, req: Request) -> Answer:
        body = self.files.get(urlsplit(req.path).path.lstrip("/"))
        if body is None:
            return 404, {}, b""
        etag = etag_of(body)
        headers = req.headers if self.if_match else \
            {k: v for k, v in req.headers.items() if k != "if-match"}
        return ranged(body, dataclasses.replace(req, headers=headers), etag)


async def read(source: HttpSource, shard: ShardInfo, start: int, end: int) -> bytes:
    parts = []
    async with aclosing(source.stream(shard, start, end)) as chunks:
        async for chunk in chunks:
            parts.append(chunk)
    return b"".join(parts)


def read_after_change(files: Files, served: Served) -> tuple[bytes | None, str]:
    """Stat a.tar, change it to new bytes of the same size, read it again: (the bytes the
    read returned, or None with the ShardChanged message). The last request is that read."""
    old = os.urandom(200_000)
    files.files["a.tar"] = old

    async def main() -> tuple[bytes | None, str]:
        source = HttpSource(FAST)
        try:
            shard = await source.stat(f"{served.url}/a.tar")
            assert shard.etag == etag_of(old)
            assert await read(source, shard, 1000, 5000) == old[1000:5000]
            files.files["a.tar"] = bytes(b ^ 0x5A for b in old)  # same size, new ETag
            try:
                return await read(source, shard, 1000, 5000), ""
            except ShardChanged as exc:
                return None, str(exc)
        finally:
            await source.aclose()

    return trio.run(main)


# -- 1: a same-size change, each validator on its own --------------------------------------------


def test_if_match_alone_catches_a_same_size_change():
    """A server that honours If-Match: the ranged GET's If-Match makes it refuse (HTTP 412)
    before it sends a byte — caught by the header itself, not by the ETag comparison after
    (which would say "ETag is now")."""
    files = Files({}, if_match=True)
    with serve(files.route) as served:
        got, why = read_after_change(files, served)
        assert got is None, "a changed shard's new bytes were served as the old version"
        assert "HTTP 412" in why, why
        new = files.files["a.tar"]
        assert served.seen[-1].headers.get("if-match") == etag_of(bytes(b ^ 0x5A for b in new))


def test_etag_comparison_alone_catches_a_same_size_change():
    """A server that ignores If-Match (the Hub's file store): only the comparison of the
    answer's ETag with the one seen at mount time can catch the change."""
    files = Files({}, if_match=False)
    with serve(files.route) as served:
        got, why = read_after_change(files, served)
        assert got is None, "a changed shard's new bytes were served as the old version"
        assert "ETag is now" in why and "at mount time" in why, why
        assert "if-match" in served.seen[-1].headers  # it was sent, and ignored


def first_member(shard: bytes) -> tuple[str, int, int]:
    """(name, data offset, size) of the first regular file of a tar."""
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        member = next(m for m in tar.getmembers() if m.isfile() and m.size)
        return member.name, member.offset_data, member.size


def test_same_size_change_behind_a_server_ignoring_if_match_is_eio(dataset: Dataset,
                                                                   mounter: Mounter):
    """README "Consistency": a shard that changed on the server is never served mixed with or
    instead of the mount-time version. Through a mount over a server that ignores If-Match,
    a same-size change (new ETag) of a shard not read yet: EIO and the log says why."""
    files = Files({name: (dataset.shard_dir / name).read_bytes()
                   for name in shard_names(dataset)}, if_match=False)
    with serve(files.route) as served:
        m = mounter.mount([brace(dataset, served.url)], None, None, "--no-warm")
        name = shard_names(dataset)[1]
        rel, offset, size = first_member(files.files[name])
        old = files.files[name]
        new = old[:offset] + bytes(b ^ 0xFF for b in old[offset:offset + size]) + \
            old[offset + size:]
        files.files[name] = new
        with pytest.raises(OSError) as info:
            got = (m.mountpoint / rel).read_bytes()
            assert got != new[offset:offset + size], "served the changed shard's new bytes"
        assert info.value.errno == errno.EIO, info.value
        assert any(r.path.endswith(name) and "if-match" in r.headers for r in served.seen)
        wait_for(lambda: "ETag is now" in m.log(), "no log line names the changed ETag")
        assert m.stats()["reader"]["eio"] >= 1


# -- 2: credentials with a session token are never shown -----------------------------------------


@dataclasses.dataclass
class RoleStore:
    moto: MotoServer
    key: str
    secret: str
    token: str


@pytest.fixture(scope="module")
def role_store(tmp_path_factory: pytest.TempPathFactory, dataset: Dataset) -> Iterator[RoleStore]:
    """moto's S3 with auth enforced, holding the dataset; temporary credentials of a role
    (moto's STS: key, secret and a session token moto checks on every request)."""
    with MotoServer(tmp_path_factory.mktemp("moto")) as moto:
        moto.client("s3").create_bucket(Bucket="shards")
        for path in sorted(dataset.shard_dir.iterdir()):
            moto.client("s3").upload_file(str(path), "shards", f"mnt/{path.name}")
        iam = moto.client("iam")
        trust = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]}
        arn = iam.create_role(RoleName="reader", AssumeRolePolicyDocument=json.dumps(trust))[
            "Role"]["Arn"]
        iam.put_role_policy(RoleName="reader", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                            "Resource": "*"}]}))
        creds = moto.client("sts").assume_role(RoleArn=arn, RoleSessionName="job")["Credentials"]
        moto.enforce_auth()
        yield RoleStore(moto, creds["AccessKeyId"], creds["SecretAccessKey"],
                        creds["SessionToken"])


@contextmanager
def credential_route(kind: str, vendor: Vendor, home: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point botocore's chain at a stand-in of `kind` that hands out the vendor's keys."""
    if kind == "container":
        with serve(container_route(vendor, "/creds", "pod-token")) as ep:
            monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", ep.url + "/creds")
            monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "pod-token")
            yield
    elif kind == "imds":
        with serve(imds_route(vendor)) as imds:
            monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
            monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.url + "/")
            yield
    else:
        token_file = home / "irsa-token"
        token_file.write_text("eyJhbGciOi.projected-service-account-token.sig")
        with serve(sts_route(vendor, [])) as sts:
            monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token_file))
            monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/reader")
            monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.url)
            yield


PROVIDERS = {"container": "container-role", "imds": "iam-role",
             "web-identity": "assume-role-with-web-identity"}


@pytest.mark.parametrize("kind", list(PROVIDERS))
def test_session_token_and_secret_are_never_shown(kind: str, role_store: RoleStore,
                                                  dataset: Dataset, mounter: Mounter,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    """README (S3): "The log names the provider used, never the secret." Temporary
    credentials carry a session token as secret as the key: neither appears in the daemon's
    log (at debug level), the terminal, an error message, `shardfs stats` or the stats."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = role_store
    args = ["--s3-endpoint", store.moto.url, "--s3-addressing", "path",
            "--s3-region", "us-east-1", "--no-warm"]
    vendor = Vendor([(store.key, store.secret)], session_token=store.token)
    shown: dict[str, str] = {}  # where -> what it showed
    with credential_route(kind, vendor, tmp_path, monkeypatch):
        m = mounter.mount(["s3://shards/mnt/"], None, None, *args)
        shown.update({"mount's stdout": m.stdout, "mount's terminal (stderr)": m.stderr})
        for rel, body in sorted(dataset.files().items())[::40]:  # signed GETs of a few
            assert (m.mountpoint / rel).read_bytes() == body
        stats = m.stats()
        assert stats["source"]["credential_providers"] == {"s3": PROVIDERS[kind]}
        human = shardfs("stats", str(m.mountpoint))
        raw = shardfs("stats", "--json", str(m.mountpoint))
        assert human.returncode == raw.returncode == 0, human.stderr + raw.stderr
        assert f"s3: {PROVIDERS[kind]}" in human.stdout
        shown.update({"shardfs stats": human.stdout + human.stderr,
                      "shardfs stats --json": raw.stdout, "the stats xattr": json.dumps(stats)})
        m.unmount()
        shown["the daemon's log"] = m.log()
        assert f"[{PROVIDERS[kind]}]" in m.log() and store.key in m.log()  # what is named
    # A token that S3 refuses: the error says so, without the token or the secret (the same
    # path whichever provider handed it out: tried with one).
    tampered = store.token[:-4] + "AAAA"
    if kind == "container":
        vendor = Vendor([(store.key, store.secret)], session_token=tampered)
        with credential_route(kind, vendor, tmp_path, monkeypatch):
            mnt, cache = mounter.paths()
            result = mounter.run("s3://shards/mnt/", str(mnt), "--cache-dir", str(cache),
                                 "--log-level", "debug", *args)
            if result.returncode == 0:
                mounter.adopt(Mount.from_result(result, mnt, cache))
            assert result.returncode != 0 and "session token" in result.stderr, result.stderr
            shown["the refused mount's error"] = result.stdout + result.stderr
            if (cache / "shardfs.log").exists():
                shown["the refused mount's log"] = (cache / "shardfs.log").read_text()
    secrets = {"session token": store.token, "refused session token": tampered,
               "secret key": store.secret}
    leaks = [f"the {what} in {where}" for where, text in shown.items()
             for what, secret in secrets.items() if secret in text]
    assert not leaks, leaks


# -- 3: `shardfs umount` leaves other FUSE filesystems alone --------------------------------------


@contextmanager
def other_fuse_mount(path: Path, env: dict[str, str] | None = None
                     ) -> Iterator[subprocess.Popen]:
    """tests/otherfs.py mounted at `path` (fuse.otherfs), unmounted again whatever happens;
    yields its process (killing it ends the connection: requests waiting on it fail)."""
    path.mkdir()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("otherfs.py")),
                             str(path)], stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    try:
        wait_for(lambda: mounted_fstype(str(path)) is not None or proc.poll() is not None,
                 "otherfs never mounted", timeout=20)
        assert proc.poll() is None, f"otherfs exited with {proc.returncode}"
        yield proc
    finally:
        if mounted_fstype(str(path)) is not None:
            subprocess.run(["fusermount3", "-u", str(path)], check=False)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False)


def test_umount_refuses_another_fuse_filesystem(tmp_path: Path):
    """README: `shardfs umount` unmounts only shardfs mounts; any other filesystem is refused
    — a FUSE one too, named by its type, and left mounted and working."""
    other = tmp_path / "other"
    with other_fuse_mount(other):
        assert mounted_fstype(str(other)) == "fuse.otherfs"
        result = shardfs("umount", str(other))
        assert result.returncode == 1, result.stderr
        assert "not a shardfs mount" in result.stderr and "fuse.otherfs" in result.stderr, \
            result.stderr
        assert mounted_fstype(str(other)) == "fuse.otherfs"
        assert (other / "hello.txt").read_bytes() == b"not shardfs\n"
        lazy = shardfs("umount", "--lazy", str(other))
        assert lazy.returncode == 1 and mounted_fstype(str(other)) == "fuse.otherfs"


# -- 4: page push only when the dataset fits the cache (and a quarter of memory) -----------------


def test_page_push_rule_with_a_faked_memory_reading(monkeypatch: pytest.MonkeyPatch):
    """`worth_pushing`: no OPEN requests, the dataset within the cache budget, and within a
    quarter of the memory available to us — each clause on its own, at its boundary."""
    gib = 1 << 30
    reading = pagepush.memory_available_to_us
    monkeypatch.setattr(pagepush, "memory_available_to_us", lambda: 8 * gib)
    w = pagepush.worth_pushing
    assert w(True, 2 * gib, 2 * gib)
    assert not w(True, 2 * gib, 2 * gib - 1)  # does not fit the cache budget
    assert not w(False, 1, 1 << 40)  # OPEN requests: pages would not survive an open
    assert not w(True, 2 * gib + 1, 1 << 40)  # more than a quarter of 8 GiB
    monkeypatch.setattr(pagepush, "memory_available_to_us", lambda: None)
    assert not w(True, 1, 1 << 40)  # memory unknown: no push
    # The reading itself: the machine's memory, or a cgroup limit (here or above) if lower.
    monkeypatch.setattr(pagepush.os, "sysconf",
                        lambda name: {"SC_PHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}[name])
    monkeypatch.setattr(pagepush, "_cgroup_limits", lambda: [])
    assert reading() == 4 * gib
    monkeypatch.setattr(pagepush, "_cgroup_limits", lambda: [6 * gib, 1 * gib])
    assert reading() == 1 * gib


@needs_shim
def test_no_page_push_when_the_dataset_exceeds_the_cache(dataset: Dataset, mounter: Mounter):
    """README (`--push-pages auto`): only when the dataset fits the cache. At the boundary,
    through mounts: a cache of exactly the dataset's size pushes, one byte less does not."""
    total = sum((dataset.shard_dir / name).stat().st_size for name in shard_names(dataset))
    source = brace(dataset, str(dataset.shard_dir))
    fits = mounter.mount([source], None, None, "--cache-size", str(total))
    stats = fits.stats()
    assert stats["dataset_bytes"] == total == stats["cache_budget_bytes"]
    assert stats["pages_pushed"] is not None  # the rule allows it here (memory is ample)
    fits.unmount()
    small = mounter.mount([source], None, None, "--cache-size", str(total - 1))
    stats = small.stats()
    assert stats["cache_budget_bytes"] == total - 1
    assert stats["pages_pushed"] is None, stats["pages_pushed"]


@needs_shim
def test_shards_read_in_place_do_not_count_against_the_cache_for_the_page_push(
        dataset: Dataset, mounter: Mounter, tmpfs: Path, nginx) -> None:
    """"The dataset fits the cache" counts only the shards fetched into it: half the shards
    read in place from a local disk, the other half over HTTP, a cache of exactly the HTTP
    half's size: the page push is on and pushes the downloaded shards' files (it was off:
    the whole dataset was counted against the cache)."""
    names = shard_names(dataset)
    half = len(names) // 2
    (nginx.root / "data").mkdir()
    for name in names[:half]:
        shutil.copy(dataset.shard_dir / name, tmpfs)
    for name in names[half:]:
        shutil.copy(dataset.shard_dir / name, nginx.root / "data")
    fetched = sum((dataset.shard_dir / name).stat().st_size for name in names[half:])
    sources = [str(tmpfs / name) for name in names[:half]] + \
        [f"{nginx.url}/data/{name}" for name in names[half:]]
    m = mounter.mount(sources, None, None, "--cache-size", str(fetched), "--no-warm",
                      in_place=None)
    stats = m.stats()
    assert stats["shards_in_place"] == half
    assert stats["fetched_bytes"] == fetched == stats["cache_budget_bytes"]
    assert stats["dataset_bytes"] > fetched
    assert stats["pages_pushed"] is not None, stats
    with tarfile.open(nginx.root / "data" / names[half]) as tar:
        first = m.mountpoint / tar.getnames()[0]
    expected = dataset.files()
    assert first.read_bytes() == expected[first.relative_to(m.mountpoint).as_posix()]
    wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "nothing pushed")
    for path in m.mountpoint.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == expected[path.relative_to(m.mountpoint).as_posix()]


# -- 5: a mountpoint holding only dot-files is not empty -----------------------------------------


def test_mountpoint_with_only_a_hidden_file_is_refused(dataset: Dataset, mounter: Mounter):
    mnt, cache = mounter.paths()
    (mnt / ".hidden").write_text("mine")
    result = mounter.run(brace(dataset, str(dataset.shard_dir)), str(mnt), "--cache-dir",
                         str(cache))
    if result.returncode == 0:
        mounter.adopt(Mount.from_result(result, mnt, cache))
    assert result.returncode != 0 and "not empty" in result.stderr, result.stderr
    assert "'.hidden'" in result.stderr and not os.path.ismount(mnt)
    assert (mnt / ".hidden").read_text() == "mine"


# -- the Lookahead buffer bound, at mount level and without torch --------------------------------


def announce(sock: socket.socket, paths: list[str]) -> dict:
    """One announcement line on the lookahead socket, and the daemon's reply."""
    sock.sendall(json.dumps({"paths": paths}).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        assert chunk, "the daemon closed the connection"
        data += chunk
    return json.loads(data)


def settled(m: Mount, key: str, quiet: float = 1.0, timeout: float = 30.0) -> dict:
    """The lookahead stats once `key` has stopped changing for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        la = m.stats()["lookahead"]
        if la[key] != last:
            last, since = la[key], time.monotonic()
        elif time.monotonic() - since >= quiet:
            return la
        assert time.monotonic() < deadline, f"lookahead {key} never settled: {la}"
        time.sleep(0.05)


def test_lookahead_buffer_bound_holds_through_a_mount(dataset: Dataset, nginx,
                                                      mounter: Mounter):
    """README (`--lookahead-buffer`): announced members are fetched ahead only as far as the
    buffer holds. Every file announced at once, nothing read: the fetching stops at the
    buffer; then reading them in order gets every byte right, mostly from the buffer."""
    dest = nginx.root / "data"
    dest.mkdir(parents=True, exist_ok=True)
    for name in shard_names(dataset):  # with their index files: nothing scanned at mount
        for f in (name, f"{name}.shardfs.idx"):
            shutil.copy(dataset.shard_dir / f, dest / f)
    buffer = 128 * 1024
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--cache-size", "256KiB", "--lookahead-buffer", str(buffer))
    stats = m.stats()
    assert stats["dataset_bytes"] > 4 * buffer and stats["lookahead_socket"]
    files = dataset.files()
    order = sorted(files, key=lambda rel: hashlib.sha256(rel.encode()).digest())  # shuffled
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect("\0" + stats["lookahead_socket"][1:])
        assert announce(sock, order)["accepted"] == len(order)
        la = settled(m, "bytes_fetched")
        assert la["buffer_bytes"] == buffer
        assert 0 < la["bytes_fetched"] <= buffer, la
        assert la["peak_buffered_bytes"] <= buffer and la["buffered_bytes"] <= buffer, la
        for rel in order:
            assert (m.mountpoint / rel).read_bytes() == files[rel], rel
        la = m.stats()["lookahead"]
        assert la["hits"] >= 0.5 * len(order), la
        assert la["peak_buffered_bytes"] <= buffer + 64 * 1024, la  # + reads not yet fetched
    assert m.stats()["reader"]["eio"] == 0
