"""Running it like a production filesystem: config, -o options, mount(8)/fstab form, systemd
readiness notifications, stats, warm, metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.devtools.nginx import free_port
from tests.conftest import SHARDFS, Dataset, Mount, Mounter, brace, stop_foreground
from tests.test_mount import assert_same_bytes, publish

REPO = Path(__file__).resolve().parents[1]
SYSTEM_BIN = Path("/usr/local/bin/shardfs")


def write_config(path: Path, **settings) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(settings))
    return path


def test_config_file_with_flag_overrides(dataset: Dataset, mounter: Mounter, tmp_path: Path):
    mnt, cache = mounter.paths()
    cfg = write_config(tmp_path / "ds.yaml", sources=[brace(dataset, str(dataset.shard_dir))],
                       mountpoint=str(mnt), cache_dir=str(cache), cache_size="1G",
                       deadline=30, prefetch="touched")
    result = mounter.run("--config", str(cfg), "--cache-size", "3M")
    assert result.returncode == 0, result.stderr
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert m.stats()["cache_budget_bytes"] == 3 << 20  # the flag wins over the file
    assert m.stats()["sources"] == [brace(dataset, str(dataset.shard_dir))]
    assert_same_bytes(dataset, mnt)


@pytest.mark.parametrize(("settings", "expect"), [
    ({"cahce_dir": "/x"}, "unknown key 'cahce_dir' (did you mean 'cache_dir'?)"),
    ({"cache_size": "12 parsecs"}, "cache_size: bad value '12 parsecs'"),
    ({"deadline": -1}, "deadline: bad value -1"),
    ({"prefetch": "sometimes"}, "allowed: touched or all"),
    ({"credentials": {"secret_access_key": "hunter2"}}, "never written inline"),
])
def test_config_errors_name_key_value_and_allowed(settings, expect, dataset, mounter: Mounter,
                                                  tmp_path: Path):
    mnt, cache = mounter.paths()
    cfg = write_config(tmp_path / "bad.yaml", sources=[str(dataset.shard_dir / "x.tar")],
                       cache_dir=str(cache), **settings)
    result = mounter.run("--config", str(cfg), str(mnt))
    assert result.returncode != 0
    assert expect in result.stderr, result.stderr
    assert "hunter2" not in result.stderr  # secrets never echoed
    assert not os.path.ismount(mnt)


def test_o_options_and_mount_helper_form(dataset: Dataset, mounter: Mounter):
    """`shardfs SOURCE MOUNTPOINT -o ...` is what mount.fuse3 runs."""
    mnt, cache = mounter.paths()
    result = subprocess.run(
        [*SHARDFS, brace(dataset, str(dataset.shard_dir)), str(mnt), "-o",
         f"ro,dev,suid,cache_dir={cache},cache_size=5M,max_fetches=2,no_warm"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert m.stats()["cache_budget_bytes"] == 5 << 20
    assert_same_bytes(dataset, mnt)
    bad = subprocess.run([*SHARDFS, "src.tar", str(mnt), "-o", "cache_sise=1G"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "did you mean 'cache_size'" in bad.stderr


@pytest.fixture
def system_shardfs() -> Iterator[None]:
    """mount(8) and systemd look for `shardfs` on the system PATH: link this checkout there
    for the test (never replacing a different installation)."""
    ours = Path(sys.executable).parent / "shardfs"
    if SYSTEM_BIN.exists() and SYSTEM_BIN.resolve() != ours.resolve():
        pytest.skip(f"{SYSTEM_BIN} belongs to another installation")
    created = not SYSTEM_BIN.exists()
    if created:
        SYSTEM_BIN.symlink_to(ours)
    try:
        yield
    finally:
        if created:
            SYSTEM_BIN.unlink()


@pytest.mark.skipif(not shutil.which("mount.fuse3"), reason="mount.fuse3 (fuse3) not installed")
def test_real_mount_t_fuse_shardfs(system_shardfs, dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    mnt, cache = mounter.paths()
    source = brace(dataset, f"{nginx.url}/data")
    result = subprocess.run(["mount", "-t", "fuse.shardfs", source, str(mnt), "-o",
                             f"ro,_netdev,nofail,cache_dir={cache},cache_size=64M"],
                            capture_output=True, text=True, timeout=120)
    try:
        assert result.returncode == 0, result.stderr
        assert os.path.ismount(mnt)  # ready when mount(8) returns
        assert_same_bytes(dataset, mnt)
        with open("/proc/mounts") as f:
            line = next(x for x in f if x.split()[1] == str(mnt))
        assert line.split()[2] == "fuse.shardfs" and "ro" in line.split()[3].split(",")
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
    assert not os.path.ismount(mnt)
    # Errors come back on stderr with a non-zero exit.
    bad = subprocess.run(["mount", "-t", "fuse.shardfs", f"{nginx.url}/nope-{{0..1}}.tar",
                          str(mnt), "-o", f"cache_dir={cache}x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "404" in bad.stderr
    assert not os.path.ismount(mnt)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_unit_verifies(system_shardfs, tmp_path: Path):
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    shutil.copy(REPO / "systemd" / "shardfs@.service", unit_dir)
    result = subprocess.run(["systemd-analyze", "verify", "shardfs@imagenet.service"],
                            cwd=unit_dir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr
    # The check can fail: a broken copy is rejected.
    broken = unit_dir / "broken@.service"
    broken.write_text((unit_dir / "shardfs@.service").read_text()
                      .replace("/usr/local/bin/shardfs", "/nonexistent/shardfs"))
    bad = subprocess.run(["systemd-analyze", "verify", "broken@x.service"], cwd=unit_dir,
                         capture_output=True, text=True)
    assert bad.returncode != 0


def _serves(mnt: Path, rel: str, data: bytes) -> bool:
    try:
        return (mnt / rel).read_bytes() == data
    except OSError:
        return False


def test_sd_notify_ready_only_when_serving_then_stopping(dataset: Dataset, tmp_path: Path):
    sock_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(60)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rel, data = next(iter(dataset.files().items()))
    env = dict(os.environ, NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="400000")
    proc = subprocess.Popen([*SHARDFS, "mount", brace(dataset, str(dataset.shard_dir)),
                             str(mnt), "-f", "--cache-dir", str(tmp_path / "cache")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    messages: list[str] = []
    try:
        env["WATCHDOG_PID"] = str(proc.pid)
        while not any("READY=1" in m for m in messages):
            msg = listener.recv(4096).decode()
            messages.append(msg)
            if "READY=1" in msg:
                # The moment systemd hears READY=1, files must already be readable.
                assert _serves(mnt, rel, data)
        statuses = [m for m in messages if m.startswith("STATUS=indexing")]
        assert statuses, messages  # progress while indexing
        deadline = time.monotonic() + 10
        seen_watchdog = False
        while time.monotonic() < deadline and not seen_watchdog:
            seen_watchdog = "WATCHDOG=1" in listener.recv(4096).decode()
        assert seen_watchdog
        proc.send_signal(signal.SIGTERM)
        while True:
            msg = listener.recv(4096).decode()
            if "STOPPING=1" in msg:
                break
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(mnt)
    finally:
        stop_foreground(proc, mnt)
        listener.close()


def test_stats_command_during_reads(dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
    assert_same_bytes(dataset, m.mountpoint)
    human = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                           text=True, check=True).stdout
    for word in ("shards", "cache", "served", "fetched", "hit ratio", "requests"):
        assert word in human, human
    snap = json.loads(subprocess.run([*SHARDFS, "stats", str(m.mountpoint), "--json"],
                                     capture_output=True, text=True, check=True).stdout)
    served = sum(len(b) for b in dataset.files().values())
    assert snap["bytes_served"] == served
    assert snap["bytes_fetched"] >= served
    assert snap["source"]["requests"] >= snap["shards"]
    assert snap["shards_cached"] + snap["shards_fetching"] <= snap["shards"]
    not_mounted = subprocess.run([*SHARDFS, "stats", str(m.cache_dir)], capture_output=True,
                                 text=True)
    assert not_mounted.returncode == 1 and "not a running shardfs mount" in not_mounted.stderr


def test_warm_fetches_subtree_then_everything(dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
    assert m.stats()["shards_cached"] == 0
    some_class = sorted((m.mountpoint / "train").iterdir())[0]
    shards_of_class = {os.getxattr(p, "user.shardfs.shard") for p in some_class.iterdir()}
    part = subprocess.run([*SHARDFS, "warm", str(some_class)], capture_output=True, text=True,
                          timeout=120)
    assert part.returncode == 0, part.stderr
    assert m.stats()["shards_cached"] == len(shards_of_class)
    full = subprocess.run([*SHARDFS, "warm", str(m.mountpoint)], capture_output=True,
                          text=True, timeout=120)
    assert full.returncode == 0, full.stderr
    assert f"{len(dataset.shards.shards)} of {len(dataset.shards.shards)} shards cached" \
        in full.stdout
    nginx.reset_log()
    assert_same_bytes(dataset, m.mountpoint)
    assert nginx.access_log() == []  # everything came from the cache


def test_prometheus_metrics(dataset: Dataset, mounter: Mounter):
    pytest.importorskip("prometheus_client")
    port = free_port()
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None,
                      "--metrics-listen", f"127.0.0.1:{port}")
    assert_same_bytes(dataset, m.mountpoint)
    time.sleep(1.5)  # the snapshot behind /metrics refreshes every second
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    text = body.decode()
    served = [line for line in text.splitlines() if line.startswith("shardfs_served_bytes_total")]
    assert served and float(served[0].split()[1]) == sum(
        len(b) for b in dataset.files().values())
    assert "shardfs_cache_budget_bytes" in text


def test_deep_cache_dir_and_foreign_user_on_control_socket(dataset: Dataset, mounter: Mounter,
                                                           tmp_path: Path):
    # Unix socket paths are limited to 108 bytes; the control socket must not care.
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "cache"
    mnt, _ = mounter.paths()
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))], mnt, deep, "--no-warm")
    warm = subprocess.run([*SHARDFS, "warm", str(m.mountpoint)], capture_output=True,
                          text=True, timeout=120)
    assert warm.returncode == 0, warm.stderr
    assert m.stats()["shards_cached"] == len(dataset.shards.shards)
    # Another user may not drive the daemon.
    address = m.stats()["control_socket"]
    probe = ("import os, sys; from shardfs.daemon.control import request, ControlError\n"
             "os.setuid(65534)\n"
             "try:\n    request(sys.argv[1], {'cmd': 'stats'})\n"
             "except ControlError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", probe, address], capture_output=True,
                            text=True, timeout=30)
    assert "permission denied" in result.stdout, result.stdout + result.stderr
