"""Directory xattr pages naming every file's shard (what the samplers read in bulk)."""

from __future__ import annotations

import os

from shardfs.catalog.dirmap import PAGE_BYTES, PREFIX, decode_page, encode_pages
from tests.conftest import Dataset, Mounter, brace


def test_pages_round_trip_with_odd_names_and_stay_under_the_xattr_limit():
    files = [(b"x\ttab\nnewline\\back", "http://a/s-0.tar"), (b"\xff\xfe", "http://a/s-1.tar")]
    files += [(b"n" * 250 + b"%d" % i, f"http://a/s-{i % 7}.tar") for i in range(2000)]
    pages = encode_pages(files)
    assert len(pages) > 1
    assert all(len(p) <= PAGE_BYTES + 1024 for p in pages)
    decoded: dict[bytes, str] = {}
    for page in pages:
        decoded.update(decode_page(page))
    assert decoded == dict(files)
    assert encode_pages([]) == []


def test_directory_pages_on_a_mount_match_the_per_file_xattrs(dataset: Dataset,
                                                             mounter: Mounter):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    for directory in sorted((m.mountpoint / "train").iterdir()):
        names = [n for n in os.listxattr(directory) if n.startswith(PREFIX.decode())]
        assert names, directory
        mapping: dict[bytes, str] = {}
        for name in names:
            mapping.update(decode_page(os.getxattr(directory, name)))
        files = sorted(directory.iterdir())
        assert len(mapping) == len(files)
        for f in files:
            assert mapping[os.fsencode(f.name)] == os.getxattr(f, "user.shardfs.shard").decode()
    # A directory without files has no pages; the root keeps its stats attribute.
    assert not [n for n in os.listxattr(m.mountpoint) if n.startswith(PREFIX.decode())]
    assert "user.shardfs.stats" in os.listxattr(m.mountpoint)
