"""Fetched shards' files are pushed into the kernel's page cache (shardfs/fuse/pagepush.py):
once a shard has arrived, reading its other files asks the daemon nothing, and the bytes are
the source's. Real mounts over nginx (--no-warm: nothing is cached while indexing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from shardfs.devtools.pagecache import resident_pages
from tests.conftest import Dataset, Mounter, brace
from tests.faultproxy import FaultProxy
from tests.test_mount import publish


def members(shard: Path) -> list[str]:
    """The regular files of a shard, in its order (read from the tar itself: nothing is
    looked up through the mount)."""
    with tarfile.open(shard) as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize(("push", "workers", "loop"), [("auto", "2", "c"), ("auto", "1", "c"),
                                                     ("off", "2", "c"),
                                                     ("auto", "1", "python"),
                                                     ("auto", "1", "c-linger")])
def test_files_of_an_arrived_shard_are_read_without_the_daemon(dataset: Dataset, nginx,
                                                               mounter: Mounter, push: str,
                                                               workers: str, loop: str,
                                                               monkeypatch):
    """With workers the daemon pushes while workers answer READs; with one process a thread
    of the daemon pushes while its loop answers them. Nothing has looked the files up (as
    with ImageFolder: listings are plain READDIR), so the pusher looks them up itself. The
    pushing loop is the shim's (C), or the Python one it replaced where the shim does not
    answer metadata (SHARDFS_PUSH_IN_PYTHON makes it the Python one). "c-linger": the shim
    lingers for the next request (SHARDFS_LINGER_US, docs/pyfuse3.md) while the pusher's
    LOOKUPs and the reads come."""
    if loop == "python":
        monkeypatch.setenv("SHARDFS_PUSH_IN_PYTHON", "1")
    elif os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("the C loop needs the shim")
    if loop == "c-linger":
        monkeypatch.setenv("SHARDFS_LINGER_US", "300")
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--push-pages", push, "--workers", workers)
    shard = max(sorted(dataset.shard_dir.glob("*.tar")), key=lambda p: len(members(p)))
    paths = [m.mountpoint / name for name in members(shard)]
    first, rest = paths[0], paths[1:]
    assert len(rest) >= 3

    def source(path: Path) -> bytes:
        return (dataset.root / path.relative_to(m.mountpoint)).read_bytes()

    assert first.read_bytes() == source(first)  # starts the shard's whole fetch
    wait_for(lambda: m.stats()["shards_cached"] >= 1, f"{shard.name} never arrived")
    if push == "auto":
        wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "nothing pushed")
        pushed = m.stats()["pages_pushed"]
        # `first` was opened (and read): not pushed again; every other file was.
        assert pushed["opened"] == 1 and pushed["unknown"] == pushed["errors"] == 0, pushed
        assert pushed["files"] == pushed["looked_up"] == len(rest), pushed
        assert pushed["bytes"] == sum(len(source(p)) for p in rest)
        assert pushed["in_c"] == (loop != "python"), pushed
    else:
        assert m.stats()["pages_pushed"] is None
    if push == "auto":
        # Each file whose pages are all in the page cache is read with no READ the daemon
        # answers. The kernel may reclaim a pushed page before it is read (these VMs run
        # DAMON's proactive reclaim, see test_node.py; likely why session 16's CI saw one
        # READ): such a file, found by mincore before its read, is let go, if most are
        # resident.
        reclaimed = []
        for path in rest:
            resident, pages = resident_pages(path)
            before = m.stats()["reader"]["reads"]
            assert path.read_bytes() == source(path), path
            served = m.stats()["reader"]["reads"] - before
            if resident < pages:
                reclaimed.append((path.name, resident, pages, served))
            else:
                assert served == 0, (path, pages)  # every byte came from the page cache
        assert len(reclaimed) <= len(rest) // 4, reclaimed
    else:
        before = m.stats()["reader"]["reads"]
        for path in rest:
            assert path.read_bytes() == source(path), path
        served = m.stats()["reader"]["reads"] - before
        assert served >= len(rest)  # each file was a READ the daemon answered


def test_files_opened_before_their_shard_arrived_are_not_pushed(dataset: Dataset, nginx,
                                                                 mounter: Mounter):
    """Their pages are in the page cache from those reads already: pushing them would only
    cost. Every file of one shard is read while its fetch is held up at the proxy."""
    publish(dataset, nginx.root)
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([brace(dataset, f"{proxy.url}/data")], None, None, "--no-warm")
        shard = max(sorted(dataset.shard_dir.glob("*.tar")), key=lambda p: len(members(p)))
        paths = [m.mountpoint / name for name in members(shard)]
        proxy.stall(60, after_bytes=1024, times=1)  # the shard's whole fetch waits
        got: dict[Path, bytes] = {}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, p.read_bytes()))
                   for p in paths]
        for t in threads:
            t.start()
        wait_for(lambda: m.stats()["reader"]["reads"] >= len(paths), "reads never arrived")
        proxy.release_stalls()
        for t in threads:
            t.join(30)
        wait_for(lambda: m.stats()["shards_cached"] >= 1, f"{shard.name} never arrived")
        pushed = m.stats()["pages_pushed"]
    assert pushed["opened"] == len(paths) and pushed["files"] == pushed["looked_up"] == 0, pushed
    for path in paths:
        assert got[path] == (dataset.root / path.relative_to(m.mountpoint)).read_bytes()


def _memory_cgroup_dir() -> Path | None:
    """A fresh memory cgroup this test may create (root, v2 or v1), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base = Path("/sys/fs/cgroup", path.lstrip("/"))
            if "memory" in (base / "cgroup.controllers").read_text().split():
                return base / f"shardfs-test-{os.getpid()}"
        elif "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory", path.lstrip("/"), f"shardfs-test-{os.getpid()}")
    return None


def test_the_memory_rule_counts_a_cgroup_limit():
    """Pushed pages are charged to the daemon's cgroup: a container's or a unit's memory
    limit, not the machine's memory, is what a quarter of must hold the dataset — also a
    limit set on a group above the daemon's (a systemd slice's MemoryMax=)."""
    group = _memory_cgroup_dir()
    if group is None or not os.access(group.parent, os.W_OK):
        pytest.skip("no writable memory cgroup here")
    limit = 256 << 20
    group.mkdir()
    leaf = group / "leaf"  # the process goes below the group that has the limit
    try:
        limit_file = group / ("memory.max" if (group / "memory.max").exists()
                              else "memory.limit_in_bytes")
        limit_file.write_text(str(limit))
        leaf.mkdir()
        code = ("import sys; sys.stdin.readline(); from shardfs.fuse.pagepush import "
                "memory_available_to_us as m, worth_pushing as w; "
                f"print(m(), w(True, {limit // 4}, 1 << 40), w(True, {limit // 4 + 1}, 1 << 40))")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            (leaf / "cgroup.procs").write_text(str(proc.pid))
            out, _ = proc.communicate("go\n", timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert out.split() == [str(limit), "True", "False"], out
        free = subprocess.run([sys.executable, "-c", code.replace("sys.stdin.readline(); ", "")],
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert int(free[0]) > limit  # outside the group: the machine's memory
    finally:
        if leaf.exists():
            leaf.rmdir()
        group.rmdir()
