"""Fetched shards' files are pushed into the kernel's page cache (shardfs/fuse/pagepush.py):
once a shard has arrived, reading its other files asks the daemon nothing, and the bytes are
the source's. Real mounts over nginx (--no-warm: nothing is cached while indexing), default
worker processes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.conftest import Dataset, Mount, Mounter, brace, shard_names
from tests.test_mount import publish

SHARD_XATTR = "user.shardfs.shard"


def files_by_shard(m: Mount) -> dict[str, list[Path]]:
    """Every file of the mount, by the shard holding it. The walk and the stats also make
    the kernel know every file's inode (as ImageFolder's walk does)."""
    out: dict[str, list[Path]] = {}
    for root, _, names in os.walk(m.mountpoint):
        for name in sorted(names):
            path = Path(root) / name
            path.stat()
            url = os.getxattr(path, SHARD_XATTR).decode()
            out.setdefault(Path(url).name, []).append(path)
    return out


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize(("push", "workers"), [("auto", "2"), ("auto", "1"), ("off", "2")])
def test_files_of_an_arrived_shard_are_read_without_the_daemon(dataset: Dataset, nginx,
                                                               mounter: Mounter, push: str,
                                                               workers: str):
    """With workers the supervisor pushes while workers answer READs; with one process a
    thread of the daemon pushes while its loop answers them."""
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--push-pages", push, "--workers", workers)
    shards = files_by_shard(m)
    assert sorted(shards) == sorted(shard_names(dataset))
    name, paths = max(shards.items(), key=lambda kv: len(kv[1]))
    first, rest = paths[0], paths[1:]
    assert len(rest) >= 3

    def source(path: Path) -> bytes:
        return (dataset.root / path.relative_to(m.mountpoint)).read_bytes()

    assert first.read_bytes() == source(first)  # starts the shard's whole fetch
    wait_for(lambda: m.stats()["shards_cached"] >= 1, f"{name} never arrived")
    if push == "auto":
        wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "nothing pushed")
        pushed = m.stats()["pages_pushed"]
        assert pushed["files"] == len(paths) and pushed["unknown"] == pushed["errors"] == 0
        assert pushed["bytes"] == sum(len(source(p)) for p in paths)
    else:
        assert m.stats()["pages_pushed"] is None
    before = m.stats()["reader"]["reads"]
    for path in rest:
        assert path.read_bytes() == source(path), path
    served = m.stats()["reader"]["reads"] - before
    if push == "auto":
        assert served == 0  # every byte came from the page cache
    else:
        assert served >= len(rest)  # each file was a READ the daemon answered
