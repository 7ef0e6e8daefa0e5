"""Stopping a daemonizing `shardfs mount` while it is still indexing (issue #13, item 1).

The server is slow for real (a FaultProxy in front of nginx stalls every transfer after the
first bytes), so the daemon is in the middle of indexing when the real signal reaches the
real waiting parent. Afterwards nothing may be left: no daemon, no mount, no cache lock, no
empty cache dir it created; and a retry with the same cache dir mounts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import SHARDFS, Dataset, Mount, Mounter, _pid_alive, brace, stop_foreground
from tests.faultproxy import FaultProxy
from tests.test_mount import publish

STALL_AFTER = 4096  # bytes of each transfer before the proxy stalls it (every shard is larger)


def _processes_naming(text: str) -> list[int]:
    """Pids whose command line contains `text` (our daemons name their mountpoint)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and _pid_alive(int(entry)):
            found.append(int(entry))
    return found


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _scanning(proxy: FaultProxy) -> bool:
    """A shard is being streamed for its index (a range longer than the 1-byte probe)."""
    return any(r.headers.get("range", "").startswith("bytes=0-")
               and r.headers.get("range") != "bytes=0-0" for r in proxy.requests)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=lambda s: signal.Signals(s).name)
def test_signal_while_indexing_stops_the_daemon(signum: int, dataset: Dataset, nginx,
                                                mounter: Mounter, tmp_path: Path):
    publish(dataset, nginx.root)
    mnt, cache = mounter.paths()
    with FaultProxy(nginx.port) as proxy:
        proxy.stall(120.0, after_bytes=STALL_AFTER)
        source = brace(dataset, f"{proxy.url}/data")
        parent = subprocess.Popen([*SHARDFS, "mount", source, str(mnt), "--cache-dir",
                                   str(cache)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert min(s.path.stat().st_size for s in dataset.shards.shards) > STALL_AFTER
            _wait_for(lambda: _scanning(proxy), "indexing to start")
            daemons = [p for p in _processes_naming(str(mnt)) if p != parent.pid]
            assert daemons, "the daemon should be running while indexing"
            assert (cache / "lock").exists()
            parent.send_signal(signum)
            out, err = parent.communicate(timeout=60)
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()
        if parent.returncode == 0:  # mounted after all: still torn down
            mounter.adopt(Mount.from_result(
                subprocess.CompletedProcess(parent.args, 0, out, err), mnt, cache))
        assert parent.returncode == 130, err
        assert err.splitlines()[-1] == "shardfs: interrupted", err  # on a line of its own
        assert "Traceback" not in err, err
        assert err.count("shardfs: interrupted") == 1, err
        for pid in daemons:
            assert not _pid_alive(pid), f"daemon {pid} still running"
        assert not os.path.ismount(mnt)
        assert not cache.exists(), f"empty cache dir left: {list(cache.rglob('*'))}"
        proxy.clear()
        # The retry is not told that another daemon holds the cache dir.
        result = mounter.run(source, str(mnt), "--cache-dir", str(cache))
        m = mounter.adopt(Mount.from_result(result, mnt, cache))
        rel, data = next(iter(dataset.files().items()))
        assert (m.mountpoint / rel).read_bytes() == data


def test_progress_on_a_terminal_counts_bytes_and_ends_its_line(dataset: Dataset, nginx,
                                                               mounter: Mounter):
    """On a terminal the indexing line moves with the bytes streamed before any shard is
    done, and the interrupt message starts on a line of its own."""
    publish(dataset, nginx.root)
    mnt, cache = mounter.paths()
    master, slave = os.openpty()
    output = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO once the last writer has gone
                return
            if not chunk:
                return
            output.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with FaultProxy(nginx.port) as proxy:
        proxy.stall(120.0, after_bytes=STALL_AFTER)
        parent = subprocess.Popen([*SHARDFS, "mount", brace(dataset, f"{proxy.url}/data"),
                                   str(mnt), "--cache-dir", str(cache)],
                                  stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        try:
            _wait_for(lambda: b"streamed" in output, "the progress line to show bytes")
            assert b"indexing shards: 0/" in output  # no shard done yet, bytes moving
            parent.send_signal(signal.SIGINT)
            parent.wait(timeout=60)
        finally:
            if parent.poll() is None:
                parent.kill()
                parent.wait()
    reader.join(10)
    os.close(master)
    text = output.decode(errors="replace").replace("\r\n", "\n")
    assert parent.returncode == 130, text
    assert "\nshardfs: interrupted\n" in text, repr(text[-300:])
    assert not os.path.ismount(mnt)


def test_foreground_mount_unmounts_on_sighup(dataset: Dataset, mounter: Mounter):
    """`shardfs mount -f` in a terminal that is closed (SIGHUP) unmounts cleanly, as on
    Ctrl-C, instead of dying and leaving a stale mount."""
    mnt, cache = mounter.paths()
    proc = subprocess.Popen([*SHARDFS, "mount", "-f", brace(dataset, str(dataset.shard_dir)),
                             str(mnt), "--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, "the mount")
        assert os.path.ismount(mnt), proc.communicate()[1]
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_foreground(proc, mnt)
    assert proc.returncode == 0, err
    assert "received SIGHUP: unmounting" in err
    assert not os.path.ismount(mnt)
