"""Running it like a production filesystem: config, -o options, mount(8)/fstab form, systemd
readiness notifications, stats, warm, metrics."""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.daemon.metrics import _METRICS
from shardfs.devtools.nginx import free_port
from tests.conftest import SHARDFS, Dataset, Mount, Mounter, brace, scrape_metrics, stop_foreground
from tests.faultproxy import FaultProxy
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
    # systemd sets WATCHDOG_PID to the service's pid before it starts: a shell exports its own
    # pid and then becomes the daemon (exec keeps the pid).
    proc = subprocess.Popen(["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", *SHARDFS, "mount",
                             brace(dataset, str(dataset.shard_dir)), str(mnt), "-f",
                             "--cache-dir", str(tmp_path / "cache")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    messages: list[str] = []
    try:
        while not any("READY=1" in m for m in messages):
            msg = listener.recv(4096).decode()
            messages.append(msg)
            if "READY=1" in msg:
                # The moment systemd hears READY=1, files must already be readable.
                assert _serves(mnt, rel, data)
        statuses = [m for m in messages if m.startswith("STATUS=indexing")]
        assert statuses, messages  # progress while indexing
        # Serving: a watchdog ping every WATCHDOG_USEC/2 (0.2 s), for as long as it runs.
        pings: list[float] = []
        listen_until = time.monotonic() + 3.0
        while time.monotonic() < listen_until:
            listener.settimeout(max(0.01, listen_until - time.monotonic()))
            try:
                msg = listener.recv(4096).decode()
            except TimeoutError:
                break
            messages.append(msg)
            if "WATCHDOG=1" in msg:
                pings.append(time.monotonic())
        listener.settimeout(60)
        assert len(pings) >= 5, (pings, messages)  # ~15 expected in 3 s; generous for load
        gaps = sorted(b - a for a, b in itertools.pairwise(pings))
        assert 0.05 <= gaps[len(gaps) // 2] <= 1.0, gaps  # median near 0.2 s
        # And a status line with the daemon's figures (sent at start, then every 5 s).
        n = len(dataset.shards.shards)
        status = [m for m in messages if re.fullmatch(
            rf"STATUS=\d+/{n} shards cached, \d+\.\d\d GB fetched, \d+\.\d\d GB served, "
            r"hit ratio (-|\d+%)", m)]
        assert status, messages
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


def _stats_json(mnt: Path) -> dict:
    out = subprocess.run([*SHARDFS, "stats", str(mnt), "--json"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return json.loads(out)


def test_stats_of_a_mount_given_a_thousand_urls(tmp_path: Path, mounter: Mounter):
    """A mount given each shard by its own URL: the stats xattr (at most 64 KiB) lists the
    first sources and counts them all, so `shardfs stats` and `doctor` still work (once
    E2BIG: the URLs alone were ~110 KB)."""
    import tarfile

    shard_dir = tmp_path / "a-shard-directory-with-a-long-name-as-datasets-have"
    shard_dir.mkdir()
    urls, sums = [], {}
    for i in range(1200):
        path = shard_dir / f"train-imagenet-1k-shuffled-{i:06d}.tar"
        data = f"sample {i}\n".encode()
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            info = tarfile.TarInfo(f"s{i:06d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        urls.append(f"file://{path}")
        sums[f"s{i:06d}.txt"] = data
    m = mounter.mount(urls, None, None, in_place=None)
    stats = m.stats()
    shown = stats["sources"]
    assert stats["sources_total"] == len(urls) and stats["shards"] == len(urls)
    assert 0 < len(shown) < len(urls) and shown == urls[: len(shown)], shown[:2]
    assert len(json.dumps(shown)) <= 17 << 10
    human = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                           text=True)
    assert human.returncode == 0 and "1200 indexed" in human.stdout, human.stderr
    doctor = subprocess.run([*SHARDFS, "doctor", str(m.mountpoint)], capture_output=True,
                            text=True, timeout=300)
    assert f"the mount has 1200 sources; checking the first {len(shown)}" in doctor.stdout, \
        doctor.stdout + doctor.stderr
    for name in ("s000000.txt", "s000777.txt", "s001199.txt"):
        assert (m.mountpoint / name).read_bytes() == sums[name]


def test_stats_command_during_reads(dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    shards = len(dataset.shards.shards)
    with FaultProxy(nginx.port) as proxy:
        # No shard waits for a slot (nor for the cold start's end). The daemon must serve
        # (and count) every read: no pages pushed into the page cache (that has its own
        # test, test_pagepush.py).
        m = mounter.mount([brace(dataset, f"{proxy.url}/data")], None, None, "--no-warm",
                          "--max-fetches", "64", "--cold-start", "0", "--push-pages", "off")
        # The whole-shard fetch the next read starts stalls after 16 KiB until released:
        # stats are read while that read waits on it.
        proxy.stall(60, after_bytes=16 * 1024, times=1)
        first = dataset.shards.shards[0].path.name
        rel = max((r for r in dataset.files()
                   if os.getxattr(m.mountpoint / r, "user.shardfs.shard").decode()
                   .endswith("/" + first)),
                  key=lambda r: int(os.getxattr(m.mountpoint / r, "user.shardfs.offset")))
        reader = threading.Thread(target=(m.mountpoint / rel).read_bytes, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        snap = _stats_json(m.mountpoint)
        while snap["reader"]["waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = _stats_json(m.mountpoint)
        human = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                               text=True, check=True).stdout
        proxy.release_stalls()
        reader.join(60)
        assert not reader.is_alive()
        # Mid-read: one fetch running, the read waiting on it, nothing complete yet.
        assert snap["shards_fetching"] == 1 and snap["shards_cached"] == 0, snap
        assert snap["reader"]["waits"] == 1 and snap["reader"]["reads"] == 1, snap["reader"]
        assert 0 < snap["reader"]["shard_bytes"] < dataset.shards.shards[0].size
        assert f"{shards} indexed, 0 cached, 1 fetching" in human, human
        assert "waited 1" in human and "member hits 0)" in human, human
        assert_same_bytes(dataset, m.mountpoint)
        # A read returns once its bytes are in; its fetch ends (sha256 checked, committed) a
        # little later: in one CI run none of the ten had when the snapshot was taken.
        deadline = time.monotonic() + 30
        after = _stats_json(m.mountpoint)
        while after["shards_fetching"] and time.monotonic() < deadline:
            time.sleep(0.05)
            after = _stats_json(m.mountpoint)
        requests_seen = len(proxy.requests)
    not_mounted = subprocess.run([*SHARDFS, "stats", str(m.cache_dir)], capture_output=True,
                                 text=True)
    assert not_mounted.returncode == 1 and "not a running shardfs mount" in not_mounted.stderr
    files = dataset.files()
    r = after["reader"]
    assert after["bytes_served"] == sum(len(b) for b in files.values())
    # The dataset fits: each shard streamed whole exactly once; indexing streamed every shard
    # once before that. Member reads only where a just-started fetch was judged slower than a
    # member read (early member reads, within their 10 % duplicate allowance).
    sizes = sum(s.size for s in dataset.shards.shards)
    assert r["shard_fetches_done"] == shards, r
    assert r["member_fetches"] == r["early_member_reads"], r
    assert r["member_bytes"] == r["early_member_bytes"] <= 0.10 * sizes, r
    # A read far ahead of a fetch may split it (reader.py, _split): no byte comes twice, but
    # the GET cut short may bring a little past its new end (counted) and what the server
    # had sent in the same block (not seen by the reader; at most a block per split).
    assert r["shard_bytes"] == sizes + r["split_overrun_bytes"], r
    assert after["bytes_indexed"] == sizes, after
    used = 2 * sizes + r["member_bytes"] + r["split_overrun_bytes"]
    assert used <= after["bytes_fetched"] <= used + r["split_reads"] * 256 * 1024, (after, r)
    assert after["shards_cached"] == shards and after["shards_fetching"] == 0
    # Every read is one of these (a read of a shard queued for a slot, in the cold start,
    # reads its member: `queued_member_reads`).
    assert r["cache_hits"] + r["frontier_hits"] + r["waits"] + r["member_hits"] \
        + r["queued_member_reads"] == r["reads"], r
    # The daemon's request count is what the proxy saw (probes, index scans, fetches).
    assert after["source"]["requests"] == requests_seen, (after["source"], requests_seen)
    assert after["source"]["retries"] == 0


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
    budget = 64 << 20
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None,
                      "--metrics-listen", f"127.0.0.1:{port}", "--cache-size", str(budget),
                      # A slot for every shard, from the first read (no cold start): no
                      # member reads. Every read reaches the daemon and is counted: no pages
                      # pushed (test_pagepush.py has that).
                      "--max-fetches", "64", "--cold-start", "0", "--push-pages", "off")
    # One file of each shard first, then every file once its shard is complete: which reads hit
    # a complete shard must not depend on how fast this machine copies a shard (CI once saw none).
    for shard in dataset.shards.shards:
        (m.mountpoint / shard.members[0][0]).read_bytes()
    deadline = time.monotonic() + 30
    while m.stats()["shards_cached"] < len(dataset.shards.shards) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_same_bytes(dataset, m.mountpoint)
    served = sum(len(b) for b in dataset.files().values())
    shards = len(dataset.shards.shards)
    sizes = sum(s.size for s in dataset.shards.shards)
    files = len(dataset.files())
    # Every metric systemd/README.md lists, with the value this run must have produced
    # (local shards: indexing seeks from header to header; each shard is then read whole once).
    exact = {
        "shardfs_shards": shards,
        "shardfs_files": files,
        "shardfs_shards_cached": shards,
        "shardfs_shards_in_place": 0,
        "shardfs_shards_fetching": 0,
        "shardfs_cache_used_bytes": sizes,
        "shardfs_cache_budget_bytes": budget,
        "shardfs_cache_evictions_total": 0,
        "shardfs_fetched_bytes_total": sizes,
        "shardfs_served_bytes_total": served,
        "shardfs_member_fetches_total": 0,
        "shardfs_fetch_errors_total": 0,
        "shardfs_eio_total": 0,
        "shardfs_source_retries_total": 0,
    }
    # The snapshot behind /metrics is refreshed every 1 s, or every 5 s when NOTIFY_SOCKET is
    # set, and the last fetch may still be committing: wait for it to settle, not a fixed time.
    deadline = time.monotonic() + 30
    metrics = scrape_metrics(port)
    while {k: metrics.get(k) for k in exact} != exact and time.monotonic() < deadline:
        time.sleep(0.2)
        metrics = scrape_metrics(port)
    assert {k: metrics.get(k) for k in exact} == exact, \
        {k: (metrics.get(k), v) for k, v in exact.items() if metrics.get(k) != v}
    assert metrics["shardfs_uptime_seconds"] > 0
    assert files <= metrics["shardfs_reads_total"] == m.stats()["reader"]["reads"]
    assert 0 < metrics["shardfs_cache_hits_total"] < metrics["shardfs_reads_total"]
    assert metrics["shardfs_source_requests_total"] >= shards
    stats = m.stats()
    assert metrics["shardfs_workers"] == stats["worker_count"]
    assert metrics["shardfs_worker_restarts_total"] == 0
    assert metrics["shardfs_opens_total"] == stats["opens"]
    assert metrics["shardfs_disk_reads_inline_total"] \
        + metrics["shardfs_disk_reads_threaded_total"] > 0
    assert metrics["shardfs_source_throttled_total"] == 0
    # Documented is exactly what the daemon serves: no metric without docs, nor the reverse.
    documented = set(re.findall(r"`(shardfs_\w+)`", (REPO / "systemd" / "README.md").read_text()))
    served = {name + ("_total" if kind == "counter" else "") for name, _, kind, _ in _METRICS}
    assert documented == served, (documented ^ served)
    assert set(exact) | {"shardfs_uptime_seconds", "shardfs_reads_total",
                         "shardfs_cache_hits_total", "shardfs_source_requests_total"} <= served
    # Served only where signed URLs say when they expire (test_signed_urls.py has it).
    only_signed = {"shardfs_signed_urls_expiry_timestamp_seconds"}
    assert documented - only_signed <= set(metrics), documented - set(metrics)
    assert not only_signed & set(metrics)


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


def test_warm_over_budget_leaves_shards_out_with_progress(dataset: Dataset, nginx,
                                                          mounter: Mounter):
    """README: `shardfs warm` fetches every shard that fits the cache, with progress; the
    shards that do not fit are left out (never evicting what it warmed a moment earlier)."""
    publish(dataset, nginx.root)
    shards = len(dataset.shards.shards)
    budget = 4 * max(s.size for s in dataset.shards.shards)
    assert budget < sum(s.size for s in dataset.shards.shards)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--cache-size", str(budget))
    result = subprocess.run([*SHARDFS, "warm", str(m.mountpoint)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    plan = re.search(r"warming (\d+) shards \(.*\); 0 already cached; (\d+) left out: they "
                     r"do not fit the cache budget", result.stdout)
    assert plan, result.stdout
    planned, left_out = int(plan.group(1)), int(plan.group(2))
    assert planned >= 4 and left_out >= 1 and planned + left_out == shards, result.stdout
    assert f"{planned} of {planned} shards cached" in result.stdout, result.stdout
    # Progress goes to stderr (a line every ~10 % when it is not a terminal), up to 100 %.
    progress = re.findall(r"warming shards: (\d+)/(\d+) \((\d+)%\)", result.stderr)
    assert progress and progress[-1] == (str(planned), str(planned), "100"), result.stderr
    assert [int(p[0]) for p in progress] == sorted(int(p[0]) for p in progress)
    stats = m.stats()
    assert stats["shards_cached"] == planned
    assert stats["evictions"] == 0 and stats["cache_used_bytes"] <= budget, stats


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (tmpfs mounts, setuid)")


@ROOT_ONLY
@pytest.mark.parametrize(("fs_size", "expect"), [
    ("64m", lambda free: int(free * 0.8)),  # 80 % of the free space ...
    ("200g", lambda free: 50 << 30),  # ... but at most 50 GiB (tmpfs pages are lazy)
], ids=["80-percent", "50-GiB-cap"])
def test_default_cache_dir_and_size(fs_size, expect, dataset: Dataset, mounter: Mounter,
                                    tmp_path: Path):
    """README: `--cache-dir` defaults to ~/.cache/shardfs/<hash of the mountpoint> ($XDG_CACHE_HOME
    when set), `--cache-size` to 80 % of the free space there, at most 50 GiB."""
    with _tmpfs(tmp_path / "xdg", fs_size) as xdg:
        free = shutil.disk_usage(xdg).free
        mnt, _ = mounter.paths()
        env = dict(os.environ, XDG_CACHE_HOME=str(xdg))
        result = subprocess.run([*SHARDFS, "mount", brace(dataset, str(dataset.shard_dir)),
                                 str(mnt)], capture_output=True, text=True, timeout=120,
                                env=env)
        tag = hashlib.sha256(str(mnt).encode()).hexdigest()[:12]
        cache = xdg / "shardfs" / tag
        m = mounter.adopt(Mount.from_result(result, mnt, cache))
        try:
            stats = m.stats()
            assert stats["cache_dir"] == str(cache)
            assert (cache / "shards").is_dir() and (cache / "lock").exists()
            assert stats["cache_budget_bytes"] == expect(free), (stats, free)
            assert_same_bytes(dataset, mnt)
        finally:
            m.unmount()


@ROOT_ONLY
def test_allow_other_and_uid_gid_on_a_real_mount(dataset: Dataset, mounter: Mounter):
    """`--allow-other` lets other users read the mount; `--uid/--gid` set the owner shown."""
    # The mountpoints must be reachable by `nobody`: pytest's tmp dirs are private (0700).
    base = Path(tempfile.mkdtemp(prefix="shardfs-other-"))
    base.chmod(0o755)
    try:
        rel, data = sorted(dataset.files().items())[0]
        source = brace(dataset, str(dataset.shard_dir))
        (base / "open").mkdir()
        (base / "closed").mkdir()
        opened = mounter.mount([source], base / "open", None, "--allow-other",
                               "--uid", "4242", "--gid", "4343")
        closed = mounter.mount([source], base / "closed", None)
        st = os.stat(opened.mountpoint / rel)
        assert (st.st_uid, st.st_gid) == (4242, 4343)
        assert os.stat(opened.mountpoint / "train").st_uid == 4242
        assert os.stat(closed.mountpoint / rel).st_uid == os.getuid()

        def as_nobody(path: Path) -> subprocess.CompletedProcess:
            return subprocess.run(["cat", str(path)], capture_output=True, user=65534,
                                  group=65534, extra_groups=[], timeout=30)

        ok = as_nobody(opened.mountpoint / rel)
        assert ok.returncode == 0 and ok.stdout == data, ok.stderr
        denied = as_nobody(closed.mountpoint / rel)
        assert denied.returncode != 0 and b"Permission denied" in denied.stderr, denied
    finally:
        mounter.cleanup()
        shutil.rmtree(base, ignore_errors=True)
