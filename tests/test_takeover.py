"""Mounts that outlive their daemon (issue 25): serving a descriptor another process mounted
(--fuse-fd), taking a live mount over (--takeover), the holder that restarts the daemon,
`shardfs restart`, the give-up rule and the systemd fd store — real mounts, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SHARDFS, needs_shim
from tests.fusefd import FuseMount, can_mount
from tests.reliability import RandomDataset, make_dataset, pid_alive, read_all

needs_root = pytest.mark.skipif(not can_mount(), reason="mount(2) of a FUSE fd needs root")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> RandomDataset:
    """~4 MB: 400 random files of ~10 KB, shards of ~512 KB."""
    return make_dataset(tmp_path_factory.mktemp("takeover"), files=400, mean_kb=10,
                        shard_kb=512, seed=25)


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def assert_all_right(ds: RandomDataset, mnt: Path, threads: int = 8) -> None:
    result = read_all(mnt, ds.sha, threads=threads)
    assert not result.wrong, result.wrong[:5]
    assert not result.errors, list(result.errors.items())[:5]
    assert result.files == len(ds.sha)


@pytest.fixture
def fuse_mount(tmp_path: Path):
    made: list[FuseMount] = []

    def make() -> FuseMount:
        mnt = tmp_path / f"mnt{len(made)}"
        mnt.mkdir()
        made.append(FuseMount(mnt))
        return made[-1]

    yield make
    for m in made:
        m.close()


def serve_fd(ds: RandomDataset, fm: FuseMount, cache: Path, *extra: str,
             foreground: bool = True) -> subprocess.Popen:
    cmd = [*SHARDFS, "mount", ds.pattern(f"file://{ds.shard_dir}"), str(fm.mountpoint),
           "--cache-dir", str(cache), "--fuse-fd", str(fm.fd), *extra]
    if foreground:
        cmd.append("-f")
    return subprocess.Popen(cmd, pass_fds=(fm.fd,), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@needs_root
@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=needs_shim)])
def test_fuse_fd_serves_a_mount_another_process_made(data, fuse_mount, tmp_path: Path,
                                                     workers: str):
    """A helper opens /dev/fuse and mounts it (fd=N, INIT not answered yet); `shardfs mount
    --fuse-fd N` serves it: every byte right, stats on the root, SIGTERM ends the daemon and
    leaves the mount to its maker."""
    fm = fuse_mount()
    proc = serve_fd(data, fm, tmp_path / "cache", "--workers", workers)
    try:
        wait_until(lambda: (tmp_path / "cache" / "session.json").exists()
                   or proc.poll() is not None, "the daemon to serve")
        assert proc.poll() is None, proc.communicate()
        assert_all_right(data, fm.mountpoint)
        stats = __import__("json").loads(os.getxattr(fm.mountpoint, "user.shardfs.stats"))
        assert stats["pid"] == proc.pid
        assert stats["worker_count"] == (2 if workers == "2" else 0)
        assert stats["takeover_ready"] is True
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.returncode == 0
        assert fm.mounted()  # the maker's to unmount
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_root
def test_fuse_fd_daemonized(data, fuse_mount, tmp_path: Path):
    """Without -f the descriptor reaches the detached daemon as well."""
    fm = fuse_mount()
    proc = serve_fd(data, fm, tmp_path / "cache", foreground=False)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    pid = int(out.rsplit("daemon pid ", 1)[1].split(")")[0])
    try:
        assert_all_right(data, fm.mountpoint)
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not pid_alive(pid), "the daemon to stop")


def test_fuse_fd_must_be_dev_fuse(data, tmp_path: Path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with open(tmp_path / "plain", "w") as f:
        result = subprocess.run([*SHARDFS, "mount", data.pattern(f"file://{data.shard_dir}"),
                                 str(mnt), "--fuse-fd", str(f.fileno()), "-f"],
                                pass_fds=(f.fileno(),), capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 1
    assert "is not a /dev/fuse descriptor" in result.stderr
    result = subprocess.run([*SHARDFS, "mount", data.pattern(f"file://{data.shard_dir}"),
                             str(mnt), "--takeover", "-f"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "--takeover needs --fuse-fd" in result.stderr


