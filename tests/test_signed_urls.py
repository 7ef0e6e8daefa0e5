"""Shards named by signed URLs (a token in the query: an Azure SAS, a presigned URL): indexes
found beside them, the signature kept out of logs, stats and xattrs, the cache kept across
tokens, a token given apart from the URLs and renewed in a live mount (docs/sources.md,
"Signed URLs")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.conftest import SHARDFS, Mount, Mounter, brace, shard_names
from tests.test_mount import assert_same_bytes, publish


def test_signed_urls_find_their_indexes_and_keep_their_signature_out_of_logs(
        dataset, nginx, mounter: Mounter):
    """Shards named by signed URLs (a token in the query: an Azure SAS, say; nginx ignores
    it): each published index is looked up beside its shard with the same query, so no shard
    is streamed to be indexed; the signature is in no log line, no error and not in the
    stats, where the URL shows with `sig=REDACTED`."""
    dest = publish(dataset, nginx.root)
    for name in shard_names(dataset):
        shutil.copy(dataset.shard_dir / f"{name}.shardfs.idx", dest / f"{name}.shardfs.idx")
    query = "?sv=2024-11-04&sr=c&sp=rl&sig=SeCrEtSiGnAtUrE%3D"
    source = brace(dataset, f"{nginx.url}/data") + query
    nginx.reset_log()
    m = mounter.mount([source], None, None, "--no-warm")
    records = nginx.access_log()
    indexes = [r for r in records if ".shardfs.idx" in r.uri]
    assert len(indexes) == len(dataset.shards.shards), [r.uri for r in records]
    assert all(r.uri.endswith(".shardfs.idx" + query) and r.status == 200 for r in indexes)
    assert [r for r in records if ".tar?" in r.uri and r.range != "bytes=0-0"] == [], \
        "a shard with a published index was streamed"
    assert_same_bytes(dataset, m.mountpoint)
    stats = m.stats()
    log = m.log()
    assert "sig=REDACTED" in log and "sig=REDACTED" in json.dumps(stats["sources"])
    assert "SeCrEtSiGnAtUrE" not in log + json.dumps(stats)
    # Nor in the files' xattrs (the shard's name, its directory's pages), which anyone who
    # may read the mount reads.
    some = sorted(dataset.files())[0]
    shard = os.getxattr(m.mountpoint / some, "user.shardfs.shard").decode()
    assert shard.endswith(".tar?sv=2024-11-04&sr=c&sp=rl&sig=REDACTED"), shard
    pages = b"".join(os.getxattr(m.mountpoint / os.path.dirname(some), name)
                     for name in os.listxattr(m.mountpoint / os.path.dirname(some)))
    assert b"sig=REDACTED" in pages and b"SeCrEt" not in pages
    # An error naming the URL: a shard that is not there.
    missing = mounter.run(f"{nginx.url}/data/absent.tar{query}", str(mounter.paths()[0]),
                          "--cache-dir", str(mounter.paths()[1]))
    assert missing.returncode != 0
    assert "absent.tar" in missing.stderr and "SeCrEtSiGnAtUrE" not in missing.stderr, \
        missing.stderr


def test_a_new_token_finds_what_the_old_one_cached(dataset, nginx, mounter: Mounter,
                                                   tmp_path: Path):
    """A remount with a fresh signed-URL token (new expiry, new signature) reuses the shards
    and indexes the old token's mount cached: one probe per shard, sent with the new token, and
    no download. A parameter that may select content (`versionid`) is part of the identity: a
    mount with one fetches the shards anew."""
    publish(dataset, nginx.root)
    cache = tmp_path / "shared-cache"
    old = "?sv=2024-11-04&se=2026-11-29T00%3A00Z&sr=c&sp=rl&sig=OlDsIgNaTuRe%3D"
    new = "?sv=2024-11-04&se=2026-12-06T00%3A00Z&sr=c&sp=rl&sig=NeWsIgNaTuRe%3D"
    m1 = mounter.mount([brace(dataset, f"{nginx.url}/data") + old], None, cache)
    assert_same_bytes(dataset, m1.mountpoint)
    m1.unmount()
    nginx.reset_log()
    m2 = mounter.mount([brace(dataset, f"{nginx.url}/data") + new], None, cache)
    assert_same_bytes(dataset, m2.mountpoint)
    records = nginx.access_log()
    assert len(records) == len(dataset.shards.shards), [(r.uri, r.range) for r in records]
    assert all(r.range == "bytes=0-0" and r.uri.endswith(".tar" + new) for r in records)
    m2.unmount()
    nginx.reset_log()
    versioned = new + "&versionid=2026-11-28"
    m3 = mounter.mount([brace(dataset, f"{nginx.url}/data") + versioned], None, cache)
    assert_same_bytes(dataset, m3.mountpoint)
    fetched = [r for r in nginx.access_log() if r.range != "bytes=0-0"]
    assert {r.uri for r in fetched} >= {f"/data/{name}{versioned}"
                                         for name in shard_names(dataset)}


def test_a_token_kept_out_of_the_source_urls(dataset, nginx, mounter: Mounter, tmp_path: Path,
                                              monkeypatch):
    """A signed URL's token given apart from the URLs, from $SHARDFS_URL_QUERY or the config's
    `credentials: {url_query: {file: ...}}` (a Kubernetes secret, say): every request carries
    it after the URL's own query, and it shows nowhere (log, stats, xattrs, errors)."""
    publish(dataset, nginx.root)
    token = "sv=2024-11-04&sr=c&sp=rl&sig=PrIvAtEsIgNaTuRe%3D"
    monkeypatch.setenv("SHARDFS_URL_QUERY", token)
    nginx.reset_log()
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")])
    assert_same_bytes(dataset, m.mountpoint)
    records = nginx.access_log()
    assert records and all(r.uri.endswith("?" + token) for r in records), \
        [r.uri for r in records if not r.uri.endswith("?" + token)]
    assert any(r.uri.endswith(".tar?" + token) and r.range != "bytes=0-0" for r in records)
    some = sorted(dataset.files())[0]
    shown = m.log() + json.dumps(m.stats()) + os.getxattr(m.mountpoint / some,
                                                          "user.shardfs.shard").decode()
    assert "PrIvAtE" not in shown
    m.unmount()
    # From a file named by the config, after a query of the URL's own; the environment's is
    # not used then.
    monkeypatch.setenv("SHARDFS_URL_QUERY", "sig=NoTtHiSoNe")
    secret = tmp_path / "sas"
    secret.write_text("?" + token + "\n")
    mnt, cache = mounter.paths()
    config = tmp_path / "shardfs.yaml"
    config.write_text(json.dumps({
        "sources": [brace(dataset, f"{nginx.url}/data") + "?versionid=7"],
        "mountpoint": str(mnt), "cache_dir": str(cache),
        "credentials": {"url_query": {"file": str(secret)}}}))
    nginx.reset_log()
    result = mounter.run("--config", str(config))
    assert result.returncode == 0, result.stderr
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert_same_bytes(dataset, m.mountpoint)
    records = nginx.access_log()
    assert records and all(r.uri.endswith("?versionid=7&" + token) for r in records)
    # A token that cannot be part of a URL: a clear error that does not show it.
    monkeypatch.setenv("SHARDFS_URL_QUERY", "sig=Two Words")
    bad = mounter.run(brace(dataset, f"{nginx.url}/data"), str(mounter.paths()[0]))
    assert bad.returncode != 0 and "SHARDFS_URL_QUERY" in bad.stderr
    assert "Words" not in bad.stderr, bad.stderr


def test_a_new_token_written_to_the_query_file_is_taken_up(dataset, nginx, mounter: Mounter,
                                                          tmp_path: Path):
    """A mount outliving its token (a SAS gate's 403 AuthenticationFailed): the URL query
    file of the config (`credentials: {url_query: {file: ...}}`) is read again at a refusal.
    Not yet renewed there: the read fails (EIO) and the log says where to write a new token;
    written: the next read succeeds, with no remount, every later request carries it, and the
    cached shards stay."""
    from tests.cloud_standins import sas_gate_route, serve

    dest = publish(dataset, nginx.root)
    for name in shard_names(dataset):  # published indexes: no shard is fetched to index it
        shutil.copy(dataset.shard_dir / f"{name}.shardfs.idx", dest / f"{name}.shardfs.idx")
    accepted = {"FiRsT"}
    seen: list[tuple[str, str, int]] = []
    token = tmp_path / "sas"
    import time

    def until(hours: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + hours * 3600))

    token.write_text(f"sv=2024-11-04&sp=rl&se={until(1)}&sig=FiRsT\n")
    files = dataset.files()
    by_shard: dict[str, list[str]] = {}
    with serve(sas_gate_route(nginx.url, accepted, seen)) as gate:
        mnt, cache = mounter.paths()
        config = tmp_path / "shardfs.yaml"
        config.write_text(json.dumps({
            "sources": [brace(dataset, f"{gate.url}/data")], "mountpoint": str(mnt),
            "cache_dir": str(cache), "credentials": {"url_query": {"file": str(token)}}}))
        result = mounter.run("--config", str(config), "--no-warm")
        assert result.returncode == 0, result.stderr
        m = mounter.adopt(Mount.from_result(result, mnt, cache))
        for rel in files:
            shard = os.getxattr(mnt / rel, "user.shardfs.shard").decode()
            by_shard.setdefault(shard, []).append(rel)
        first, second = sorted(by_shard.values())[:2]
        for rel in first:  # one shard fetched with the first token
            assert (mnt / rel).read_bytes() == files[rel]
        # The token expires; nobody has written a new one yet.
        accepted.clear()
        accepted.add("SeCoNd")
        with open(mnt / second[0], "rb") as f:
            try:
                f.read()
            except OSError as exc:
                assert exc.errno == 5  # EIO
            else:
                raise AssertionError("a read with a refused token succeeded")
        assert f"write a new token to {token}" in m.log()
        assert [status for _, sig, status in seen if sig == "FiRsT"][-1] == 403
        # A new token in the file: taken up at the next refusal, no remount.
        token.write_text(f"?sv=2024-11-04&sp=rl&se={until(48)}&sig=SeCoNd")
        seen.clear()
        assert_same_bytes(dataset, mnt)
        assert "the URL query was read again from" in m.log()
        # The stats (and metrics) follow the token in effect: the new one's expiry.
        assert abs(m.stats()["signed_until"] - (time.time() + 48 * 3600)) < 60
        refused = [entry for entry in seen if entry[2] == 403]
        assert len(refused) == 1 and refused[0][1] == "FiRsT", refused  # then renewed
        served = [entry for entry in seen if entry[2] != 403]
        assert served and all(sig == "SeCoNd" for _, sig, _ in served)
        # Every shard but the first was fetched now; the first stayed cached.
        fetched = {path for path, _, _ in served}
        first_shard = by_shard_url_path(by_shard, first)
        assert first_shard not in fetched and len(fetched) == len(by_shard) - 1, fetched
        # `shardfs doctor MOUNTPOINT` checks the store as the mount sees it: with the token
        # from the file the mount's stats name (without it, every shard is refused).
        from tests.test_doctor import doctor

        checked = doctor(str(mnt))
        assert f"{len(by_shard)} shards reachable" in checked.stdout, checked.stdout


def by_shard_url_path(by_shard: dict[str, list[str]], files: list[str]) -> str:
    """The URL path of the shard (as its xattr names it) that holds `files`."""
    from urllib.parse import urlsplit

    return next(urlsplit(url).path for url, held in by_shard.items() if held == files)


def test_doctor_and_the_log_say_when_signatures_expire(dataset, nginx, mounter: Mounter,
                                                       tmp_path: Path, monkeypatch):
    """A SAS's `se` (nginx ignores it, so only shardfs can tell): `doctor` fails an expired
    one, notes one that expires within a day, and shows when a later one does; the mount's
    log says when, as a warning within a day (for a token from $SHARDFS_URL_QUERY too)."""
    import importlib.util
    import time

    from shardfs.devtools.nginx import free_port
    from tests.conftest import scrape_metrics
    from tests.test_doctor import doctor

    publish(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")

    def sas(hours: float) -> str:
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + hours * 3600))
        return f"sv=2024-11-04&sr=c&sp=rl&se={until}&sig=ExPiRy"

    def verdict(query: str) -> dict:
        result = doctor(f"{source}?{query}", "--cache-dir", str(tmp_path / "c"), "--json")
        return next(c for c in json.loads(result.stdout)["checks"]
                    if c["name"] == "signed URLs")

    expired = verdict(sas(-1))
    assert expired["verdict"] == "fail" and "expired at" in expired["detail"], expired
    soon = verdict(sas(2))
    assert soon["verdict"] == "note" and "in 2.0 h" in soon["detail"], soon
    later = verdict(sas(24 * 10))
    assert later["verdict"] == "ok" and "(in 10 days)" in later["detail"], later

    port = free_port()
    m = mounter.mount([f"{source}?{sas(24 * 10)}"], None, None,
                      "--metrics-listen", f"127.0.0.1:{port}")
    assert "signed URLs are valid until" in m.log() and "(in 10 days)" in m.log()
    until = m.stats()["signed_until"]
    assert abs(until - (time.time() + 240 * 3600)) < 60, until
    if importlib.util.find_spec("prometheus_client") is not None:
        name = "shardfs_signed_urls_expiry_timestamp_seconds"
        deadline = time.monotonic() + 10
        while name not in (metrics := scrape_metrics(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics[name] == until, metrics
    monkeypatch.setenv("SHARDFS_URL_QUERY", sas(3))
    m = mounter.mount([source])
    line = next(x for x in m.log().splitlines() if "signed URLs expire at" in x)
    assert " WARNING " in line and "in 3.0 h" in line and "mount again" in line, line
    assert abs(m.stats()["signed_until"] - (time.time() + 3 * 3600)) < 60
    # `shardfs top` shows it: --json, and a line of its own on the screen.
    top = subprocess.run([*SHARDFS, "top", "--json", "--count", "1", str(m.mountpoint)],
                         capture_output=True, text=True, timeout=60)
    record = json.loads(top.stdout.splitlines()[-1])["mounts"][0]
    assert abs(record["signed_until"] - (time.time() + 3 * 3600)) < 60, record
    if shutil.which("tmux"):
        from tests.test_top import Tmux, _top_shell, _wait_for

        screen = Tmux(tmp_path)
        try:
            screen.start(_top_shell(m.mountpoint, tmp_path / "top-status"))
            line = _wait_for(lambda: next((x for x in screen.screen().splitlines()
                                           if x.strip().startswith("signed")), None),
                             30, "top's signed URLs line")
            assert "valid until" in line and "(in 3.0 h)  SOON" in line, line
        finally:
            screen.kill()
    # Without a signature that says when: no expiry anywhere.
    monkeypatch.delenv("SHARDFS_URL_QUERY")
    m = mounter.mount([source])
    assert m.stats()["signed_until"] is None and "signed URLs" not in m.log()


def test_a_renewed_token_carries_over_to_the_serving_source(dataset, nginx, tmp_path: Path):
    """The daemon indexes with one HttpSource and serves with the next (`take_over`): a token
    renewed from its file while indexing is the one the serving source sends first, with no
    refusal to find it again."""
    import trio

    from shardfs.sources import HttpSource, SourceSettings
    from tests.cloud_standins import sas_gate_route, serve

    publish(dataset, nginx.root)
    token = tmp_path / "sas"
    token.write_text("sp=rl&sig=OlD")
    accepted = {"NeW"}
    seen: list[tuple[str, str, int]] = []
    with serve(sas_gate_route(nginx.url, accepted, seen)) as gate:
        settings = SourceSettings(url_query="sp=rl&sig=OlD", url_query_file=str(token),
                                  deadline=10, backoff_initial=0.01)
        url = f"{gate.url}/data/{shard_names(dataset)[0]}"

        async def main() -> None:
            indexing = HttpSource(settings)
            token.write_text("sp=rl&sig=NeW")  # renewed before the first refusal
            await indexing.stat(url)
            await indexing.aclose()
            serving = HttpSource(settings)
            serving.take_over(indexing)
            seen.clear()
            await serving.stat(url)
            await serving.aclose()

        trio.run(main)
    assert seen == [(f"/data/{shard_names(dataset)[0]}", "NeW", 206)], seen
