"""Bad input gets one clear message, a non-zero exit, and no mount left behind."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from shardfs.devtools.nginx import free_port
from tests.conftest import Mounter, brace
from tests.faultproxy import FaultProxy
from tests.test_mount import publish


def _fails(mounter: Mounter, *args: str, mountpoint: Path | None = None,
           expect: str) -> subprocess.CompletedProcess:
    mnt, cache = mounter.paths()
    was_mounted = mountpoint is not None and os.path.ismount(mountpoint)
    mnt = mountpoint or mnt
    result = mounter.run(*args, str(mnt), "--cache-dir", str(cache), "--deadline", "3",
                         "--timeout", "1", timeout=60)
    assert result.returncode != 0, result.stdout
    assert expect.lower() in result.stderr.lower(), result.stderr
    assert result.stderr.count("shardfs: error:") == 1, result.stderr
    assert os.path.ismount(mnt) == was_mounted  # nothing left behind, nothing taken away
    return result


def test_unreachable_server(mounter: Mounter):
    port = free_port()
    result = _fails(mounter, f"http://127.0.0.1:{port}/x-{{0..1}}.tar",
                    expect=f"cannot connect to http://127.0.0.1:{port}")
    assert "check the URL and that the server is running" in result.stderr, result.stderr


def test_not_found(nginx, mounter: Mounter):
    _fails(mounter, f"{nginx.url}/missing-{{000..002}}.tar", expect="404")


def test_not_a_tar(tmp_path: Path, mounter: Mounter):
    (tmp_path / "junk.tar").write_bytes(os.urandom(5000))
    _fails(mounter, str(tmp_path / "junk.tar"), expect="not a usable tar shard")


def test_truncated_tar(tmp_path: Path, mounter: Mounter):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("a.bin")
        info.size = 100_000
        tf.addfile(info, io.BytesIO(os.urandom(100_000)))
    (tmp_path / "cut.tar").write_bytes(buf.getvalue()[:50_000])
    _fails(mounter, str(tmp_path / "cut.tar"), expect="cut.tar")


def test_truncated_tar_over_http(nginx, mounter: Mounter):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("a.bin")
        info.size = 100_000
        tf.addfile(info, io.BytesIO(os.urandom(100_000)))
    (nginx.root / "cut.tar").write_bytes(buf.getvalue()[:50_000])
    _fails(mounter, f"{nginx.url}/cut.tar", expect="truncated")


def test_bad_patterns(mounter: Mounter, tmp_path: Path):
    _fails(mounter, str(tmp_path / "x-{5..1}.tar"), expect="backwards")
    _fails(mounter, str(tmp_path / "x-{1..2.tar"), expect="unbalanced")
    _fails(mounter, str(tmp_path / "x-{}.tar"), expect="cannot expand")


def test_missing_mountpoint(dataset, mounter: Mounter, tmp_path: Path):
    _fails(mounter, brace(dataset, str(dataset.shard_dir)),
           mountpoint=tmp_path / "nope", expect="does not exist")


def test_busy_mountpoint(dataset, mounter: Mounter):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    _fails(mounter, brace(dataset, str(dataset.shard_dir)), mountpoint=m.mountpoint,
           expect="busy")
    assert os.path.ismount(m.mountpoint)  # the first mount is untouched


def test_unwritable_cache_dir(dataset, mounter: Mounter, tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    mnt, _ = mounter.paths()
    result = mounter.run(brace(dataset, str(dataset.shard_dir)), str(mnt),
                         "--cache-dir", str(blocker / "cache"))
    assert result.returncode != 0
    assert "cache dir" in result.stderr
    assert not os.path.ismount(mnt)


def test_cache_dir_in_use(dataset, mounter: Mounter):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    mnt, _ = mounter.paths()
    result = mounter.run(brace(dataset, str(dataset.shard_dir)), str(mnt),
                         "--cache-dir", str(m.cache_dir))
    assert result.returncode != 0 and "in use by another shardfs daemon" in result.stderr
    assert not os.path.ismount(mnt)


def test_kill_9_leaves_no_partial_shard_and_stale_mount_is_cleaned(dataset, nginx,
                                                                   mounter: Mounter):
    publish(dataset, nginx.root)
    with FaultProxy(nginx.port) as proxy:
        source = brace(dataset, f"{proxy.url}/data")
        m = mounter.mount([source], None, None, "--no-warm", "--no-holder")  # a mount that dies
        # The next request (the whole-shard fetch the read below starts) stalls after 16 KiB,
        # so the daemon is killed with that shard's .part file half written.
        proxy.stall(60, after_bytes=16 * 1024, times=1)
        shard = dataset.shards.shards[0]
        rel = max((r for r in dataset.files()
                   if os.getxattr(m.mountpoint / r, "user.shardfs.shard").decode()
                   .endswith("/" + shard.path.name)),
                  key=lambda r: int(os.getxattr(m.mountpoint / r, "user.shardfs.offset")))
        reader = threading.Thread(target=_read_quietly, args=(m.mountpoint / rel,), daemon=True)
        reader.start()
        parts = m.cache_dir / "shards"
        deadline = time.monotonic() + 30
        while not list(parts.glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(parts.glob("*.part")), "the fetch never started"
        os.kill(m.pid, signal.SIGKILL)
        reader.join(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.statvfs(m.mountpoint)
            except OSError:
                break
            time.sleep(0.05)
        left = list(parts.glob("*.part"))
        assert len(left) == 1, left  # what the kill left behind: a partial shard, no final name
        assert not [p for p in parts.iterdir() if not p.name.endswith(".part")]
        proxy.clear()
        m2 = mounter.mount([source], m.mountpoint, m.cache_dir, "--no-warm")
        assert not list(parts.glob("*.part"))  # removed at start-up, never taken as complete
        for rel, data in dataset.files().items():
            assert (m2.mountpoint / rel).read_bytes() == data
        m2.unmount()


def _read_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):  # the daemon is killed under this read
        path.read_bytes()


def test_server_down_gives_eio_then_recovers(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--deadline", "2", "--timeout", "1")
    files = sorted(dataset.files().items())
    nginx.stop()
    began = time.monotonic()
    with pytest.raises(OSError) as info:
        (m.mountpoint / files[0][0]).read_bytes()
    assert info.value.errno == 5  # EIO
    assert time.monotonic() - began < 15  # bounded by the deadline, no hang
    nginx.start()  # same port
    for rel, data in files:
        assert (m.mountpoint / rel).read_bytes() == data
    log = m.log()
    assert "retrying in" in log  # one line per retry ...
    assert "unreachable, no progress" in log  # ... and the failure that gave EIO


def test_umount_command(dataset, mounter: Mounter):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    result = subprocess.run([sys.executable, "-m", "shardfs", "umount", str(m.mountpoint)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(m.mountpoint)
