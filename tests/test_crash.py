"""Crash safety and a full disk under the cache, through real mounts (issue #7).

- kill -9 of the daemon while many readers make it fetch many shards at once, several times
  over the same cache dir and mountpoint: the next mount cleans the stale mountpoint, drops
  every partial shard, keeps (and does not refetch) every complete one, and every file still
  reads back with the right sha256.
- ENOSPC: the cache dir on a tmpfs smaller than the dataset, with a --cache-size larger than
  the tmpfs. The reader must degrade (shrink the cache to what the disk holds, read members
  directly), log it, and never return wrong bytes or EIO; so must indexing with warming.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from shardfs.cache.shardcache import shard_key
from shardfs.daemon.mountpoint import is_stale
from shardfs.devtools.nginx import Nginx
from shardfs.sources import HttpSource
from tests.conftest import Mounter
from tests.faultproxy import Fault, FaultProxy
from tests.reliability import RandomDataset, make_dataset, pid_alive, read_all, report


@pytest.fixture(scope="module")
def crashdata(tmp_path_factory: pytest.TempPathFactory) -> RandomDataset:
    """~4 MB of random files in about a dozen shards of ~384 KB."""
    return make_dataset(tmp_path_factory.mktemp("crashdata"), files=200, mean_kb=14,
                        shard_kb=384, seed=11, big_every=40, big_kb=200)


def keys_by_url(urls: list[str]) -> dict[str, str]:
    """Cache key of each shard URL, computed the way the daemon does (URL + size + ETag)."""

    async def main() -> dict[str, str]:
        source = HttpSource()
        try:
            return {url: shard_key((await source.stat(url)).identity) for url in urls}
        finally:
            await source.aclose()

    return trio.run(main)


def complete_shards(cache: Path) -> set[str]:
    shards = cache / "shards"
    return {p.name for p in shards.iterdir() if "." not in p.name} if shards.exists() else set()


def partial_shards(cache: Path) -> set[str]:
    shards = cache / "shards"
    return {p.name for p in shards.glob("*.part")} if shards.exists() else set()


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} did not die"
        time.sleep(0.02)


def test_kill_9_during_heavy_fetching(request, mounter: Mounter, nginx: Nginx, crashdata,
                                      tmp_path: Path):
    ds = crashdata
    ds.publish(nginx.root / "data")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    cycles, kills, refetched_ok = 3, 0, 0
    parts_dropped = 0
    with FaultProxy(nginx.port) as proxy:
        pattern = ds.pattern(f"{proxy.url}/data")
        urls = [f"{proxy.url}/data/{name}" for name in ds.names]
        key_url = {k: u for u, k in keys_by_url(urls).items()}
        for cycle in range(cycles):
            before = complete_shards(cache)
            parts = partial_shards(cache)
            # The next mount cleans the stale mountpoint left by the kill.
            assert cycle == 0 or is_stale(str(mnt))
            # --no-holder: what a kill does to a mount nobody takes over (test_takeover.py
            # has the holder's side)
            m = mounter.mount([pattern], mnt, cache, "--no-warm", "--max-fetches", "6",
                              "--no-holder")
            assert not partial_shards(cache), "a partial shard survived a restart"
            assert before <= complete_shards(cache), "complete shards were lost"
            parts_dropped += len(parts)
            if parts:
                assert "removed partial shard left by an earlier run" in m.stderr + m.log()
            nginx.reset_log()
            # Slow every transfer down (16 KiB per request, 10 ms before each answer) so the
            # kill finds many fetches in flight.
            proxy.set_fault(Fault(stall_s=0.01, truncate_after=16 * 1024))
            readers = threading.Thread(target=read_all, args=(m.mountpoint, ds.sha),
                                       kwargs={"threads": 12, "seed": cycle, "timeout": 60})
            readers.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done = complete_shards(cache) - before
                if done and len(partial_shards(cache)) >= 2:
                    break
                time.sleep(0.005)
            at_kill = complete_shards(cache), partial_shards(cache)
            os.kill(m.pid, signal.SIGKILL)
            kills += 1
            wait_gone(m.pid)
            readers.join(60)  # their reads fail (ENOTCONN) once the daemon is gone
            assert not readers.is_alive()
            assert at_kill[0] - before and at_kill[1], "the kill did not catch fetches in flight"
            proxy.clear()
            # No request of this cycle re-read a shard that was complete when it started.
            refetched = {r.uri for r in nginx.access_log()
                         if r.range != "bytes=0-0" and r.uri.endswith(".tar")
                         and shard_key_of(r.uri, key_url) in before}
            assert not refetched, refetched
            refetched_ok += len(before)

        # Last mount: every byte right, and complete shards from before are not fetched again.
        before = complete_shards(cache)
        m = mounter.mount([pattern], mnt, cache, "--no-warm")
        assert not partial_shards(cache)
        nginx.reset_log()
        result = read_all(m.mountpoint, ds.sha, threads=8)
        assert not result.wrong and not result.errors and result.files == len(ds.sha)
        fetched = {r.uri for r in nginx.access_log() if r.range != "bytes=0-0"}
        assert not {u for u in fetched if shard_key_of(u, key_url) in before}
    report(request, "kill -9 during heavy fetching", crashes=kills,
           partial_shards_dropped=parts_dropped, complete_shards_reused=refetched_ok + len(before),
           files=result.files, bytes_verified=result.bytes_verified, wrong=len(result.wrong),
           eio=len(result.errors))


def shard_key_of(uri: str, key_url: dict[str, str]) -> str | None:
    for key, url in key_url.items():
        if url.endswith(uri):
            return key
    return None


# -- a full disk under the cache ----------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1.5 MiB tmpfs (the dataset is ~4.6 MB), always unmounted afterwards. Request it
    before `mounter`, so that the mounts on top of it are torn down first."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "tmpfs"
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k,mode=0700", "tmpfs",
                             str(where)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("warm", [False, True], ids=["fetch", "warm-while-indexing"])
def test_disk_full_under_the_cache(request, small_tmpfs: Path, mounter: Mounter, nginx: Nginx,
                                   crashdata, tmp_path: Path, warm: bool):
    ds = crashdata
    ds.publish(nginx.root / "data")
    log_file = tmp_path / "daemon.log"  # the log must not depend on the full disk
    extra = ["--cache-size", "1G", "--log-file", str(log_file)] + ([] if warm else ["--no-warm"])
    m = mounter.mount([ds.pattern(f"{nginx.url}/data")], None, small_tmpfs / "cache", *extra)
    result = read_all(m.mountpoint, ds.sha, threads=8)
    # Twice: the second epoch runs on the degraded cache.
    again = read_all(m.mountpoint, ds.sha, threads=8, seed=1)
    stats = m.stats()
    log = m.stderr + log_file.read_text()  # before and after daemonizing
    assert not result.wrong and not again.wrong, (result.wrong[:3], again.wrong[:3])
    assert not result.errors and not again.errors, (result.errors, again.errors)
    assert result.files == again.files == len(ds.sha)
    assert stats["reader"]["eio"] == 0
    assert pid_alive(m.pid)
    assert "disk full" in log, log[-3000:]
    # The budget came down to what the disk holds, and the cache stays within it.
    assert stats["cache_budget_bytes"] <= 1536 * 1024
    assert stats["cache_used_bytes"] <= stats["cache_budget_bytes"]
    st = os.statvfs(small_tmpfs)
    report(request, f"disk full under the cache ({'warm' if warm else 'fetch'})",
           faults=log.count("disk full"), files=result.files + again.files,
           bytes_verified=result.bytes_verified + again.bytes_verified,
           wrong=len(result.wrong) + len(again.wrong),
           eio=len(result.errors) + len(again.errors),
           member_fetches=stats["reader"]["member_fetches"],
           tmpfs_used_kib=(st.f_blocks - st.f_bfree) * st.f_frsize // 1024)


def test_disk_already_full_is_a_clear_error(small_tmpfs: Path, mounter: Mounter, nginx: Nginx,
                                             crashdata):
    """Not even the lock file fits: one `shardfs: error:` line, no traceback, no mount."""
    crashdata.publish(nginx.root / "data")
    with open(small_tmpfs / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    mnt, _ = mounter.paths()
    result = mounter.run(crashdata.pattern(f"{nginx.url}/data"), str(mnt), "--cache-dir",
                         str(small_tmpfs / "cache"), "--cache-size", "1G", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("shardfs: error:") == 1, result.stderr
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
    assert not os.path.ismount(mnt)
