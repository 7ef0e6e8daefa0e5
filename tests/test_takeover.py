"""Mounts that outlive their daemon (issue 25): serving a descriptor another process mounted
(--fuse-fd), taking a live mount over (--takeover), the holder that restarts the daemon,
`shardfs restart`, the give-up rule and the systemd fd store — real mounts, real signals."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from shardfs.devtools.nginx import Nginx
from shardfs.devtools.pagecache import drop_pages
from tests.conftest import SHARDFS, Mounter, needs_shim
from tests.faultproxy import FaultProxy
from tests.fusefd import FuseMount, can_mount
from tests.reliability import (
    RandomDataset,
    ReadResult,
    make_dataset,
    pid_alive,
    read_all,
    wait_until,
)

needs_root = pytest.mark.skipif(not can_mount(), reason="mount(2) of a FUSE fd needs root")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> RandomDataset:
    """~4 MB: 400 random files of ~10 KB, shards of ~512 KB."""
    return make_dataset(tmp_path_factory.mktemp("takeover"), files=400, mean_kb=10,
                        shard_kb=512, seed=25)


GAPS: list[tuple[str, float]] = []


def report_gap(what: str, seconds: float) -> None:
    """Kill -> next answered read, printed at the end of the run (-s) for docs/reliability.md."""
    GAPS.append((what, seconds))
    print(f"takeover gap: {what}: {seconds:.3f} s")


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
@needs_shim
def test_fuse_fd_serves_a_mount_another_process_made(data, fuse_mount, tmp_path: Path):
    """A helper opens /dev/fuse and mounts it (fd=N, INIT not answered yet); `shardfs mount
    --fuse-fd N --workers 2` serves it: every byte right, stats on the root, SIGTERM ends the
    daemon and leaves the mount to its maker."""
    fm = fuse_mount()
    proc = serve_fd(data, fm, tmp_path / "cache", "--workers", "2")
    try:
        wait_until(lambda: (tmp_path / "cache" / "session.json").exists()
                   or proc.poll() is not None, "the daemon to serve")
        assert proc.poll() is None, proc.communicate()
        assert_all_right(data, fm.mountpoint)
        stats = json.loads(os.getxattr(fm.mountpoint, "user.shardfs.stats"))
        assert stats["pid"] == proc.pid and stats["worker_count"] == 2
        assert stats["takeover_ready"] is True and stats["connection_kept_by"] is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.returncode == 0
        assert fm.mounted()  # the maker's to unmount
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@needs_root
def test_fuse_fd_daemonized_one_process(data, fuse_mount, tmp_path: Path):
    """Without -f (and with the daemon alone) the descriptor reaches the detached daemon; no
    holder is left (whoever passed the descriptor keeps it)."""
    fm = fuse_mount()
    proc = serve_fd(data, fm, tmp_path / "cache", "--workers", "1", foreground=False)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "holder pid" not in out
    pid = int(out.rsplit("daemon pid ", 1)[1].split(")")[0])
    try:
        assert_all_right(data, fm.mountpoint)
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: not pid_alive(pid), "the daemon to stop")


@needs_root
@needs_shim
def test_takeover_of_a_fuse_fd_mount_mid_read(data, fuse_mount, tmp_path: Path):
    """What the CSI mounter does when it restarts: the descriptor's holder (here the test)
    starts `--fuse-fd N --takeover` on the same cache dir after the daemon (with 2 workers)
    was SIGKILLed while 8 reader processes read: 0 errors, 0 wrong bytes."""
    fm = fuse_mount()
    cache = tmp_path / "cache"
    first = serve_fd(data, fm, cache, "--workers", "2", "--no-warm")
    second = None
    try:
        wait_until(lambda: (cache / "session.json").exists() or first.poll() is not None,
                   "the first daemon to serve")
        record = json.loads((cache / "session.json").read_text())
        assert record["format"] == "shardfs-session-1" and record["pid"] == first.pid
        assert record["init"]["major"] == 7 and len(record["shards"]) == len(data.names)
        readers = Readers(fm.mountpoint, data.sha)
        time.sleep(0.3)
        first.kill()
        first.wait()
        second = serve_fd(data, fm, cache, "--workers", "2", "--no-warm", "--takeover")
        readers.check(len(data.sha))
        wait_until(lambda: stats(fm.mountpoint)["worker_count"] == 2, "2 workers serving")
        after = stats(fm.mountpoint)
        assert after["pid"] == second.pid and after["takeovers"] == 1
        assert json.loads((cache / "session.json").read_text())["takeovers"] == 1
        second.send_signal(signal.SIGTERM)
        second.wait(30)
        assert second.returncode == 0
        assert fm.mounted()  # the descriptor's maker unmounts
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


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




# -- the holder: kill -9, restart, give-up, stop -------------------------------------------
def _read_chunk(job: tuple[str, dict[str, str], int]) -> ReadResult:
    mnt, expected, seed = job
    return read_all(Path(mnt), expected, threads=1, seed=seed)


def read_in_processes(mnt: Path, sha: dict[str, str], processes: int = 8,
                      seed: int = 0) -> ReadResult:
    """Every file, split over `processes` reader processes, each checking sha256."""
    names = sorted(sha)
    jobs = [(str(mnt), {n: sha[n] for n in names[i::processes]}, seed + i)
            for i in range(processes)]
    total = ReadResult()
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        for result in pool.map(_read_chunk, jobs, timeout=180):
            total.merge(result)
    return total


def stats(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.shardfs.stats"))


class Readers:
    """8 reader processes over every file, in the background."""

    def __init__(self, mnt: Path, sha: dict[str, str], seed: int = 0) -> None:
        self.result: list[ReadResult] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(read_in_processes(mnt, sha, seed=seed)))
        self.thread.start()

    def check(self, files: int) -> ReadResult:
        self.thread.join(240)
        assert not self.thread.is_alive(), "readers hang"
        (result,) = self.result
        assert not result.wrong, result.wrong[:5]
        assert not result.errors, list(result.errors.items())[:5]
        assert result.files == files
        return result


def kill_and_time(mnt: Path, probe: Path) -> tuple[int, float]:
    """SIGKILL the daemon (the pid of stats); seconds until `probe`, a file whose pages were
    dropped, is read again through the mount once the old processes are gone (the kill ->
    next answered read gap)."""
    before = stats(mnt)
    drop_pages(probe)
    os.kill(before["pid"], signal.SIGKILL)
    killed = time.monotonic()
    # not answered by what is left of the old daemon: its workers live a little longer
    wait_until(lambda: not any(pid_alive(p) for p in [before["pid"], *before["workers"]]),
               "the old daemon's processes to end", 10)
    probe.read_bytes()
    return before["pid"], time.monotonic() - killed


def wait_serving_again(mnt: Path, old_pid: int, timeout: float = 30) -> dict:
    wait_until(lambda: stats(mnt)["pid"] != old_pid, "a new daemon", timeout)
    return stats(mnt)


def spare_ready(m) -> None:
    """Wait until the holder's spare daemon stands by (imported), as it does in production
    a few seconds after each start."""
    holder = stats(m.mountpoint)["holder_pid"]

    def standing_by() -> bool:
        for child in Path(f"/proc/{holder}/task/{holder}/children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            # standing by = blocked reading its standby pipe (its wchan is a pipe read); the
            # daemon serving now was a spare too, and is not blocked there
            if b"--standby-fd" in cmd and "pipe" in Path(f"/proc/{child}/wchan").read_text():
                return True
        return False

    wait_until(standing_by, "the spare daemon to stand by", 60)


def holder_alive(m) -> int:
    pid = stats(m.mountpoint)["holder_pid"]
    assert pid and pid_alive(pid)
    return pid


@needs_shim
def test_kill_9_of_the_daemon_mid_read_costs_no_read_error(data, mounter: Mounter):
    """8 reader processes read every file (checked) while the daemon is SIGKILLed: the holder
    keeps the connection, a spare daemon takes the mount over; 0 errors, 0 wrong bytes, the
    mount answers again within 5 s; the log says how the daemon ended."""
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--no-warm",
                      "--workers", "1")
    before = stats(m.mountpoint)
    assert before["connection_kept_by"] == "holder" and before["takeover_ready"]
    assert f"daemon pid {before['pid']}, holder pid {before['holder_pid']}" in m.stdout
    holder = holder_alive(m)
    spare_ready(m)
    probe = m.mountpoint / sorted(data.sha)[-1]
    readers = Readers(m.mountpoint, data.sha)
    time.sleep(0.3)
    old, gap = kill_and_time(m.mountpoint, probe)
    readers.check(len(data.sha))
    assert gap < 5, gap
    after = stats(m.mountpoint)
    assert after["pid"] != old and after["takeovers"] == 1
    assert after["holder_pid"] == holder
    assert f"daemon {old} killed by SIGKILL; a new daemon takes the mount over" in m.log()
    report_gap("kill -9, file://, 1 process", gap)
    # SIGTERM to the daemon that took over: it unmounts (libfuse did not mount it there) and
    # the holder ends with it; nothing is left running or mounted.
    os.kill(after["pid"], signal.SIGTERM)
    wait_until(lambda: not pid_alive(holder), "the holder to end", 30)
    wait_until(lambda: not _processes_using(m.cache_dir), "every process to end", 30)
    assert not os.path.ismount(m.mountpoint)


@needs_shim
def test_kill_9_during_a_cold_http_fetch_with_two_workers(data, nginx: Nginx,
                                                          mounter: Mounter):
    """Every GET waits 0.1 s (a cold epoch over HTTP, reads waiting in the workers for the
    daemon's fetches); the daemon is SIGKILLed twice: its workers die with it, the zygote
    requeues what they held, the spare takes over with 2 new workers; 0 errors."""
    data.publish(nginx.root / "cold")
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([data.pattern(f"{proxy.url}/cold")], None, None, "--no-warm",
                          "--workers", "2")
        spare_ready(m)
        proxy.stall(0.1)
        names = sorted(data.sha)
        readers = Readers(m.mountpoint, data.sha, seed=3)
        for i in range(2):
            time.sleep(0.5)
            old, gap = kill_and_time(m.mountpoint, m.mountpoint / names[i])
            assert gap < 5, gap
            report_gap("kill -9, HTTP cold fetch, --workers 2", gap)
            wait_serving_again(m.mountpoint, old)
            # stats are answered as soon as one worker serves: wait for the second
            wait_until(lambda: stats(m.mountpoint)["worker_count"] == 2, "2 workers serving")
            assert stats(m.mountpoint)["takeovers"] == i + 1
            if i == 0:
                spare_ready(m)
        readers.check(len(data.sha))


@needs_shim
def test_kill_9_of_a_daemon_reading_shards_in_place(data, mounter: Mounter):
    """--in-place on, two workers: the daemon SIGKILLed under 8 readers; the new daemon
    links the shards again (the links are not adopted, docs/design.md) before it serves:
    0 errors, every shard still read in place, nothing copied."""
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None,
                      "--in-place", "on", "--workers", "2")
    shards = stats(m.mountpoint)["shards"]
    assert stats(m.mountpoint)["shards_in_place"] == shards
    spare_ready(m)
    readers = Readers(m.mountpoint, data.sha, seed=5)
    time.sleep(0.3)
    old, gap = kill_and_time(m.mountpoint, m.mountpoint / sorted(data.sha)[0])
    assert gap < 5, gap
    after = wait_serving_again(m.mountpoint, old)
    readers.check(len(data.sha))
    assert after["takeovers"] == 1 and after["shards_in_place"] == shards, after
    entries = list(os.scandir(m.cache_dir / "shards"))
    assert len(entries) == shards and all(e.is_symlink() for e in entries)
    assert stats(m.mountpoint)["bytes_fetched"] == 0


@needs_shim
def test_restart_in_a_loop_during_reads(data, mounter: Mounter):
    """`shardfs restart` twice in a row while 8 reader processes read every file: each returns
    once a new daemon (started with the installed code) serves; 0 errors."""
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--no-warm",
                      "--workers", "2", "--cache-size", "2M")
    holder = holder_alive(m)
    readers = Readers(m.mountpoint, data.sha, seed=5)
    pids = [stats(m.mountpoint)["pid"]]
    for _ in range(2):
        result = subprocess.run([*SHARDFS, "restart", str(m.mountpoint)], capture_output=True,
                                text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        pids.append(stats(m.mountpoint)["pid"])
        assert f"daemon pid {pids[-2]} -> {pids[-1]}" in result.stdout
    readers.check(len(data.sha))
    s = stats(m.mountpoint)
    assert s["takeovers"] == 2 and s["holder_pid"] == holder
    assert len(set(pids)) == 3 and not any(pid_alive(p) for p in pids[:-1])
    assert "received SIGUSR1: exiting, leaving the mount to the next daemon" in m.log()


@needs_shim
def test_a_daemon_that_keeps_dying_is_given_up(data, mounter: Mounter, monkeypatch):
    """After N deaths in M seconds (here 3 in 60) the holder detaches the mount, says why and
    exits: nothing is left running or mounted."""
    monkeypatch.setenv("SHARDFS_HOLDER_GIVE_UP", "3/60")
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--workers",
                      "1")
    holder = holder_alive(m)
    for i in range(3):
        pid = stats(m.mountpoint)["pid"]
        os.kill(pid, signal.SIGKILL)
        if i < 2:
            wait_serving_again(m.mountpoint, pid)
    wait_until(lambda: not pid_alive(holder), "the holder to give up", 60)
    assert not os.path.ismount(m.mountpoint)
    log = m.log()
    assert "3 deaths within 60 s, giving up: detaching the mount" in log
    assert not _processes_using(m.cache_dir)


# -- reads during the gap: bounded by --deadline ----------------------------------------------
def timed_read(path: Path) -> tuple[float, OSError | None, bytes]:
    """Read a file; (seconds it took, the error or None, the bytes)."""
    start = time.monotonic()
    try:
        data = path.read_bytes()
    except OSError as exc:
        return time.monotonic() - start, exc, b""
    return time.monotonic() - start, None, data


def read_in_background(path: Path) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(timed_read(path)), daemon=True)
    thread.start()
    return thread, out


def stop_everything(m) -> None:
    """Teardown for a mount whose holder may be stuck in a gap: the mount detached, then
    every process of ours named by its cache dir killed by pid."""
    if os.path.ismount(m.mountpoint):
        subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], capture_output=True)
    for pid in _processes_using(m.cache_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@needs_shim
def test_reads_in_a_gap_longer_than_the_deadline_fail_then_work_again(data, mounter: Mounter,
                                                                      monkeypatch):
    """The new daemon hangs 12 s before taking over (SHARDFS_TAKEOVER_DELAY_S); with
    `--deadline 2` a reader blocked in the gap gets EIO once the gap passed the deadline (not
    after the takeover, which would have answered it), a read after that fails at once, and
    once the new daemon serves every file reads right again."""
    monkeypatch.setenv("SHARDFS_TAKEOVER_DELAY_S", "12")
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--no-warm",
                      "--workers", "1", "--deadline", "2")
    try:
        names = sorted(data.sha, key=lambda n: -data.sizes[n])  # not an empty one
        for name in names[:3]:
            (m.mountpoint / name).stat()  # looked up now: the reads below need only READ
            drop_pages(m.mountpoint / name)
        spare_ready(m)
        old = stats(m.mountpoint)
        os.kill(old["pid"], signal.SIGKILL)
        killed = time.monotonic()
        thread, out = read_in_background(m.mountpoint / names[0])
        thread.join(60)
        assert not thread.is_alive(), "a read in the gap hangs"
        (elapsed, error, _), = out
        assert isinstance(error, OSError) and error.errno == errno.EIO, (error, elapsed)
        failed_after = time.monotonic() - killed
        assert failed_after >= 2 * 0.9, failed_after  # not before the deadline
        assert stats_pid_or_none(m.mountpoint) is None  # no daemon answered it: the holder
        elapsed, error, _ = timed_read(m.mountpoint / names[1])
        assert isinstance(error, OSError) and error.errno == errno.EIO
        wait_until(lambda: stats_pid_or_none(m.mountpoint) not in (None, old["pid"]),
                   "a new daemon", 120)
        new = stats(m.mountpoint)
        assert new["takeovers"] == 1 and new["holder_pid"] == old["holder_pid"]
        _, error, body = timed_read(m.mountpoint / names[2])
        assert error is None and hashlib.sha256(body).hexdigest() == data.sha[names[2]]
        assert_all_right(data, m.mountpoint)
        log = m.log()
        assert "its --deadline is 2 s): failing its reads with EIO" in log
        assert "requests failed with EIO while no daemon served" in log
        print(f"reads during a 12 s gap, --deadline 2: EIO after {failed_after:.2f} s")
    finally:
        stop_everything(m)


def stats_pid_or_none(mnt: Path) -> int | None:
    """The serving daemon's pid, or None where the stats fail (no daemon: the holder's EIO)."""
    try:
        return stats(mnt)["pid"]
    except OSError:
        return None


@needs_shim
def test_a_takeover_that_never_comes_up_is_given_up_in_bounded_time(data, mounter: Mounter,
                                                                    monkeypatch):
    """Every new daemon hangs (SHARDFS_TAKEOVER_DELAY_S=1000): readers get EIO after
    `--deadline 1`, and with the give-up rule at 2 deaths (the kill, then one takeover not
    serving within the start timeout of max(30 s, deadline)) the holder detaches the mount
    and ends instead of leaving readers waiting forever."""
    monkeypatch.setenv("SHARDFS_TAKEOVER_DELAY_S", "1000")
    monkeypatch.setenv("SHARDFS_HOLDER_GIVE_UP", "2/1")  # a 1 s window: only 'in a row' fires
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--no-warm",
                      "--workers", "1", "--deadline", "1")
    try:
        name = max(data.sha, key=lambda n: data.sizes[n])
        (m.mountpoint / name).stat()
        drop_pages(m.mountpoint / name)
        holder = holder_alive(m)
        os.kill(stats(m.mountpoint)["pid"], signal.SIGKILL)
        killed = time.monotonic()
        _, error, _ = timed_read(m.mountpoint / name)
        assert isinstance(error, OSError) and error.errno == errno.EIO, error
        wait_until(lambda: not pid_alive(holder), "the holder to give up", 120)
        given_up = time.monotonic() - killed
        assert not os.path.ismount(m.mountpoint)
        log = m.log()
        assert "not serving within the start timeout of 30 s: killed" in log
        assert "2 deaths in a row with no daemon serving in between (start timeout 30 s), " \
            "giving up: detaching the mount" in log
        wait_until(lambda: not _processes_using(m.cache_dir), "every process to end", 30)
        print(f"a takeover that never comes up: given up after {given_up:.1f} s")
    finally:
        stop_everything(m)


@needs_shim
def test_stopping_the_holder_during_a_hung_takeover(data, mounter: Mounter, monkeypatch):
    """SIGTERM to the holder while a new daemon hangs before taking over (past the deadline,
    the holder failing reads): the holder kills it, unmounts and ends; nothing is left."""
    monkeypatch.setenv("SHARDFS_TAKEOVER_DELAY_S", "1000")
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--no-warm",
                      "--workers", "1", "--deadline", "1")
    try:
        holder = holder_alive(m)
        os.kill(stats(m.mountpoint)["pid"], signal.SIGKILL)
        wait_until(lambda: "failing its reads with EIO" in m.log(), "the deadline to pass", 60)
        os.kill(holder, signal.SIGTERM)
        wait_until(lambda: not pid_alive(holder), "the holder to end", 30)
        assert not os.path.ismount(m.mountpoint)
        assert "stop asked while no daemon serves: the holder ends" in m.log()
        wait_until(lambda: not _processes_using(m.cache_dir), "every process to end", 30)
    finally:
        stop_everything(m)


def _processes_using(cache_dir: Path) -> list[int]:
    """Pids whose command line names `cache_dir` (our daemons, spares and holder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(cache_dir).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@needs_shim
@pytest.mark.parametrize("how", ["umount", "sigterm-holder"])
def test_stopping_ends_holder_and_daemon_together(data, mounter: Mounter, how: str):
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--workers",
                      "1")
    holder = holder_alive(m)
    if how == "umount":
        subprocess.run([*SHARDFS, "umount", str(m.mountpoint)], check=True, timeout=60)
    else:
        os.kill(holder, signal.SIGTERM)
    wait_until(lambda: not pid_alive(holder), "the holder to end", 30)
    wait_until(lambda: not _processes_using(m.cache_dir), "every process to end", 30)
    assert not os.path.ismount(m.mountpoint)


@needs_shim
def test_without_resend_the_mount_behaves_as_before(data, mounter: Mounter, monkeypatch):
    """The old-kernel path (forced with SHARDFS_NO_RESEND): said once at start; a killed
    daemon leaves a dead mount, as before the holder existed, and the holder leaves too."""
    monkeypatch.setenv("SHARDFS_NO_RESEND", "1")
    m = mounter.mount([data.pattern(f"file://{data.shard_dir}")], None, None, "--workers",
                      "1")
    s = stats(m.mountpoint)
    assert s["connection_kept_by"] is None and s["holder_pid"] is None
    said = "this mount cannot outlive its daemon: this kernel has no FUSE_NOTIFY_RESEND"
    assert m.log().count(said) == 1  # (the terminal saw the mount-time lines too)
    holder = int(m.stdout.rsplit("holder pid ", 1)[1].split(")")[0])
    result = subprocess.run([*SHARDFS, "restart", str(m.mountpoint)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "no holder keeps" in result.stderr
    os.kill(s["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(holder), "the holder to leave with its daemon")
    with pytest.raises(OSError) as err:
        os.statvfs(m.mountpoint)
    assert err.value.errno == errno.ENOTCONN


# -- systemd: the fd store, against a stand-in speaking systemd's documented protocol ------
class SystemdStandin:
    """What systemd does for `Type=notify` + `FileDescriptorStoreMax=` + `Restart=`: a
    NOTIFY_SOCKET receiving READY=1 and FDSTORE=1 (descriptor attached, FDNAME=); a restart
    hands stored descriptors back from fd 3 on with LISTEN_FDS, LISTEN_PID (the new main
    process's own pid) and LISTEN_FDNAMES."""

    def __init__(self, tmp: Path, cmd: list[str]) -> None:
        self.cmd = cmd
        self.address = str(tmp / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.stored: dict[str, int] = {}
        self.ready = False
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "NOTIFY_SOCKET": self.address, "SHARDFS_FDSTORE": "1"}
        self.ready = False
        if not self.stored:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            return
        names = list(self.stored)
        fds = [self.stored[n] for n in names]
        # In the child, before exec (so LISTEN_PID is the daemon's own pid): descriptors to
        # 3, 4, ... and the variables set, as systemd does.
        script = ("import os, sys\n"
                  f"fds = {fds!r}\n"
                  "moved = [os.dup(fd) for fd in fds]\n"
                  "for i, fd in enumerate(moved):\n"
                  "    os.dup2(fd, 3 + i)\n"
                  "    os.set_inheritable(3 + i, True)\n"
                  f"os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='{len(fds)}',"
                  f" LISTEN_FDNAMES='{':'.join(names)}')\n"
                  "os.execvp(sys.argv[1], sys.argv[1:])\n")
        self.proc = subprocess.Popen([sys.executable, "-c", script, *self.cmd], env=env,
                                     pass_fds=fds, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def receive(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 4096, 8)
            except TimeoutError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines()
                          if "=" in line)
            if fields.get("READY") == "1":
                self.ready = True
            if fields.get("FDSTORE") == "1" and fds:
                name = fields.get("FDNAME", "stored")
                if name in self.stored:  # the same connection sent again: keep one
                    os.close(self.stored[name])
                self.stored[name] = fds[0]
            elif fds:
                for fd in fds:
                    os.close(fd)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            assert time.monotonic() < deadline, "no READY=1"
            assert self.proc is not None and self.proc.poll() is None, "the daemon exited"
            self.receive()

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "the daemon did not exit"
            self.receive()
        self.receive()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for fd in self.stored.values():
            os.close(fd)
        self.stored.clear()
        self.sock.close()


@needs_shim
def test_systemd_fd_store_keeps_the_mount(data, tmp_path: Path):
    """Under (a stand-in for) systemd: the daemon stores the connection (FDSTORE=1); killed,
    it is restarted (Restart=on-failure) and takes the mount over from LISTEN_FDS with no read
    error; `systemctl restart` (RestartKillSignal=SIGUSR1) replaces it the same way;
    `systemctl stop` (SIGTERM) unmounts."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = [*SHARDFS, "mount", data.pattern(f"file://{data.shard_dir}"), str(mnt),
           "--cache-dir", str(tmp_path / "cache"), "--workers", "1", "--no-warm", "-f"]
    systemd = SystemdStandin(tmp_path, cmd)
    try:
        systemd.start()
        systemd.wait_ready()
        assert list(systemd.stored) == ["shardfs-fuse"]
        assert stats(mnt)["connection_kept_by"] == "systemd"
        # Page push is off by itself here: killed mid-lookup through the mount, the daemon
        # could not finish dying until a new one answered, and systemd (like this stand-in)
        # starts the new one only once the old one is gone (systemd/README.md).
        assert stats(mnt)["pages_pushed"] is None
        readers = Readers(mnt, data.sha, seed=7)
        time.sleep(0.3)
        assert systemd.proc is not None
        systemd.proc.kill()  # kill -9: Restart=on-failure starts it again
        assert systemd.wait_exit() == -signal.SIGKILL
        systemd.start()
        systemd.wait_ready()
        readers.check(len(data.sha))
        assert stats(mnt)["takeovers"] == 1
        systemd.proc.send_signal(signal.SIGUSR1)  # systemctl restart
        assert systemd.wait_exit() == 0
        assert os.path.ismount(mnt)
        systemd.start()
        systemd.wait_ready()
        assert_all_right(data, mnt)
        assert stats(mnt)["takeovers"] == 2
        systemd.proc.send_signal(signal.SIGTERM)  # systemctl stop
        assert systemd.wait_exit() == 0
        assert not os.path.ismount(mnt)
    finally:
        systemd.close()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)])


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_the_unit_verifies(tmp_path: Path):
    """systemd-analyze verify accepts the unit (ExecStart pointed at a binary that exists
    here, as verify checks that it does)."""
    unit = Path(__file__).parent.parent / "systemd" / "shardfs@.service"
    text = unit.read_text()
    assert "FileDescriptorStoreMax=1" in text and "RestartKillSignal=SIGUSR1" in text
    copy = tmp_path / "shardfs@test.service"
    copy.write_text(text.replace("/usr/local/bin/shardfs", shutil.which("true") or "/bin/true"))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "shardfs@test.service" not in result.stderr, result.stderr
