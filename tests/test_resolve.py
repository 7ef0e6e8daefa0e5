"""resolve_sources: braces, paths, manifests (nginx, files, S3), prefix and directory listings."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from shardfs.catalog.resolve import (
    ResolveError,
    join_url,
    parse_text_manifest,
    resolve_ref,
    resolve_sources,
)
from shardfs.devtools.nginx import Nginx
from shardfs.sources import NotFound, SourceError, Sources, SourceSettings, to_url
from tests.moto_fixture import MotoServer

FAST = SourceSettings(timeout=2.0, deadline=3.0, backoff_initial=0.02, backoff_max=0.2)
WIDS_KIND = "wids-shard-index-v1"


def resolve(specs: list[str], settings: SourceSettings = FAST) -> list[str]:
    async def main() -> list[str]:
        sources = Sources(settings)
        try:
            return await resolve_sources(specs, sources)
        finally:
            await sources.aclose()

    return trio.run(main)


def wids(shardlist: list, **extra: object) -> str:
    doc = {"__kind__": WIDS_KIND, "wids_version": 1, **extra,
           "shardlist": [{"url": u, "nsamples": 10, "filesize": 1} if isinstance(u, str) else u
                         for u in shardlist]}
    return json.dumps(doc)


# -- braces and paths --------------------------------------------------------------------------


def test_braces_and_paths_keep_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    urls = resolve(["rel/x-{0..2}.tar", "/abs/a b#.tar", "http://h/s-{a,b}.tar",
                    "s3://bkt/k/t-{000..001}.tar", "rel/x-0.tar"])
    assert urls == [
        f"file://{tmp_path}/rel/x-0.tar", f"file://{tmp_path}/rel/x-1.tar",
        f"file://{tmp_path}/rel/x-2.tar", "file:///abs/a%20b%23.tar",
        "http://h/s-a.tar", "http://h/s-b.tar",
        "s3://bkt/k/t-000.tar", "s3://bkt/k/t-001.tar",
        f"file://{tmp_path}/rel/x-0.tar",  # duplicates are kept
    ]


def test_bad_patterns_and_nothing(tmp_path: Path) -> None:
    for spec in ("x-{0..", "x-{3..1}.tar", "x-{a}.tar"):
        with pytest.raises(ResolveError) as info:
            resolve([spec])
        assert isinstance(info.value, SourceError)
    with pytest.raises(ResolveError, match="no shards"):
        resolve([])


# -- manifests over HTTP (nginx) ---------------------------------------------------------------


def test_text_manifest_over_http(nginx: Nginx) -> None:
    (nginx.root / "lists").mkdir()
    (nginx.root / "lists" / "train.txt").write_text(
        "# training shards\n"
        "\n"
        "train-000000.tar\n"
        "   sub/train-000001.tar   \n"
        "../up/train-000002.tar\n"
        "/root-level.tar\n"
        "https://cdn.example/abs.tar\n"
        "s3://bkt/key.tar\n"
        "  # indented comment\n"
    )
    base = f"{nginx.url}/lists"
    assert resolve([f"{base}/train.txt", f"{nginx.url}/x.tar"]) == [
        f"{base}/train-000000.tar", f"{base}/sub/train-000001.tar",
        f"{nginx.url}/up/train-000002.tar", f"{nginx.url}/root-level.tar",
        "https://cdn.example/abs.tar", "s3://bkt/key.tar", f"{nginx.url}/x.tar"]


def test_wids_index_over_http(nginx: Nginx) -> None:
    (nginx.root / "ds").mkdir()
    (nginx.root / "ds" / "index.json").write_text(wids(
        ["train-0.tar", "sub/train-1.tar", "http://elsewhere/train-2.tar"], name="imagenet"))
    (nginx.root / "ds" / "based.json").write_text(wids(["a.tar", "b.tar"], base="../shards"))
    (nginx.root / "ds" / "abs-base.json").write_text(
        wids(["a.tar"], base="http://mirror.example/data"))
    (nginx.root / "ds" / "part2.json").write_text(wids(["p2.tar"]))
    (nginx.root / "ds" / "multi.json").write_text(json.dumps({
        "wids_version": 1,
        "shardlist": [{"url": "top.tar", "nsamples": 1}],
        "datasets": [
            {"shardlist": [{"url": "inline.tar", "nsamples": 1}], "base": "/inl"},
            {"source_url": "part2.json"},
        ],
    }))
    (nginx.root / "ds" / "looks-like-text.txt").write_text(wids(["sniffed.tar"]))
    ds = f"{nginx.url}/ds"
    assert resolve([f"{ds}/index.json"]) == [
        f"{ds}/train-0.tar", f"{ds}/sub/train-1.tar", "http://elsewhere/train-2.tar"]
    assert resolve([f"{ds}/based.json"]) == [f"{nginx.url}/shards/a.tar",
                                              f"{nginx.url}/shards/b.tar"]
    assert resolve([f"{ds}/abs-base.json"]) == ["http://mirror.example/data/a.tar"]
    assert resolve([f"{ds}/multi.json"]) == [
        f"{ds}/top.tar", f"{nginx.url}/inl/inline.tar", f"{ds}/p2.tar"]
    assert resolve([f"{ds}/looks-like-text.txt"]) == [f"{ds}/sniffed.tar"]


def test_relative_urls_resolve_as_wids_does(nginx: Nginx) -> None:
    """Without a "base", wids resolves shard URLs against the index's directory; so do we."""
    wids_specs = pytest.importorskip("wids.wids_specs", reason="wids (webdataset) is missing")
    refs = ["a.tar", "sub/b.tar", "../c.tar", "/d.tar", "http://other.example/e.tar"]
    text = wids(refs)
    (nginx.root / "d").mkdir()
    (nginx.root / "d" / "i.json").write_text(text)
    index_url = f"{nginx.url}/d/i.json"
    theirs = wids_specs.resolve_dsdesc(json.loads(text), base=wids_specs.urldir(index_url))
    assert resolve([index_url]) == [s["url"] for s in theirs["shardlist"]]


def test_manifest_errors(nginx: Nginx) -> None:
    files = {
        "empty.txt": "# nothing here\n\n",
        "bad.json": "{not json",
        "kind.json": json.dumps({"__kind__": "something-else", "shardlist": []}),
        "nourl.json": json.dumps({"__kind__": WIDS_KIND, "shardlist": [{"nsamples": 3}]}),
        "noshards.json": json.dumps({"__kind__": WIDS_KIND, "shardlist": []}),
        "array.json": json.dumps(["a.tar"]),
        "nolist.json": json.dumps({"name": "x"}),
        "binary.txt": "",
    }
    for name, text in files.items():
        (nginx.root / name).write_text(text)
    (nginx.root / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    expected = {
        "empty.txt": "lists no shards", "bad.json": "not valid JSON",
        "kind.json": "unknown manifest kind", "nourl.json": r"shardlist\[0\] has no \"url\"",
        "noshards.json": "lists no shards", "array.json": "must be an object",
        "nolist.json": "no \"shardlist\"", "binary.txt": "not UTF-8",
    }
    for name, pattern in expected.items():
        with pytest.raises(ResolveError, match=pattern):
            resolve([f"{nginx.url}/{name}"])
    with pytest.raises(NotFound, match=r"missing\.txt: manifest not found"):
        resolve([f"{nginx.url}/missing.txt"])


# -- local manifests and directories -----------------------------------------------------------


def test_local_manifests_hold_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "l.txt").write_text("a b#1.tar\n../shards/x%41.tar\n/data/abs.tar\n"
                                 "http://h/u.tar\nfile:///x/y.tar\n")
    (lists / "w.json").write_text(wids(["p.tar"], base="../pool"))
    monkeypatch.chdir(tmp_path)
    assert resolve(["lists/l.txt", str(lists / "w.json")]) == [
        to_url(str(lists / "a b#1.tar")), to_url(str(tmp_path / "shards" / "x%41.tar")),
        "file:///data/abs.tar", "http://h/u.tar", "file:///x/y.tar",
        to_url(str(tmp_path / "pool" / "p.tar"))]


def test_local_directory_is_listed(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("b.tar", "a.tar", "c.tar.gz", "d.tgz", "e.tar.zst", "f.tar.lz4", "notes.txt",
                 "x.tar.shardfs.idx"):
        (shards / name).write_bytes(b"")
    (shards / "sub.tar").mkdir()  # a directory, even with a shard-like name, is skipped
    expected = [to_url(str(shards / n))
                for n in ("a.tar", "b.tar", "c.tar.gz", "d.tgz", "e.tar.zst", "f.tar.lz4")]
    assert resolve([str(shards)]) == expected
    assert resolve([str(shards) + "/"]) == expected
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResolveError, match=r"no shards in directory .*empty: 0 entries"):
        resolve([str(tmp_path / "empty")])
    # A missing file is not listed or checked here: the catalog reports it.
    assert resolve([str(tmp_path / "missing")]) == [to_url(str(tmp_path / "missing"))]


def test_ref_resolution_helpers() -> None:
    assert join_url("s3://b/dir/list.txt", "x.tar") == "s3://b/dir/x.tar"
    assert join_url("s3://b/dir/list.txt", "../y.tar") == "s3://b/y.tar"
    assert join_url("ais://b/dir/list.txt", "/top.tar") == "ais://b/top.tar"
    assert join_url("s3://b/dir/list.txt", "//other/z.tar") == "s3://other/z.tar"
    assert join_url("https://h:8/a/b.txt?sig=1", "c.tar") == "https://h:8/a/c.tar"
    assert resolve_ref("gs://x/y.tar", "s3://b/l.txt") == "gs://x/y.tar"
    assert resolve_ref("sub/", "file:///m/l.json") == "file:///m/sub/"
    assert parse_text_manifest("a.tar\r\n#c\r\n\r\nb.tar", "http://h/d/l.txt") == [
        "http://h/d/a.tar", "http://h/d/b.tar"]


# -- S3 prefixes and manifests (moto) ----------------------------------------------------------


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        s3 = server.client("s3")
        s3.create_bucket(Bucket="data")
        keys = [f"train/train-{i:06d}.tar" for i in (3, 0, 2, 1)] + [
            "train/train-000000.tar.shardfs.idx", "train/README.md", "train/val/v-0.tar",
            "only-dirs/a/x.tar", "only-dirs/b/y.tar", "top.tar",
            "lists/train.txt", "lists/index.json"]
        for key in keys:
            s3.put_object(Bucket="data", Key=key, Body=b"")
        s3.put_object(Bucket="data", Key="lists/train.txt",
                      Body=b"# relative to the list\n../train/train-000001.tar\nextra.tar\n")
        s3.put_object(Bucket="data", Key="lists/index.json",
                      Body=wids(["../train/train-000002.tar"]).encode())
        yield server


@pytest.fixture
def s3_env(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SourceSettings:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return dataclasses.replace(FAST, s3_endpoint=moto.url)


def test_s3_prefixes_are_listed(s3_env: SourceSettings) -> None:
    train = [f"s3://data/train/train-{i:06d}.tar" for i in range(4)]
    assert resolve(["s3://data/train/"], s3_env) == train  # sorted, direct children only
    assert resolve(["s3://data/train/train-"], s3_env) == train  # a key prefix
    assert resolve(["s3://data"], s3_env) == ["s3://data/top.tar"]  # the bucket's top level
    # Braces name shards; they are not listed (nor checked: the catalog stats them).
    assert resolve(["s3://data/train/train-{000001..000002}.tar",
                    "s3://data/train/train-000009.tar"], s3_env) == [
        train[1], train[2], "s3://data/train/train-000009.tar"]
    with pytest.raises(ResolveError, match=r"no shards under s3://data/only-dirs/: 0 objects.*"
                                           r"sub-prefixes \(not searched\): s3://data/only-dirs/a/"):
        resolve(["s3://data/only-dirs/"], s3_env)
    with pytest.raises(ResolveError, match="no shards under s3://data/nothing/"):
        resolve(["s3://data/nothing/"], s3_env)
    with pytest.raises(NotFound, match="no such bucket 'nobucket'"):
        resolve(["s3://nobucket/x/"], s3_env)


def test_s3_manifests(s3_env: SourceSettings) -> None:
    assert resolve(["s3://data/lists/train.txt", "s3://data/lists/index.json"], s3_env) == [
        "s3://data/train/train-000001.tar", "s3://data/lists/extra.tar",
        "s3://data/train/train-000002.tar"]
    with pytest.raises(NotFound, match="manifest not found"):
        resolve(["s3://data/lists/missing.txt"], s3_env)
