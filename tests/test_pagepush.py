"""Fetched shards' files are pushed into the kernel's page cache (shardfs/fuse/pagepush.py):
once a shard has arrived, reading its other files asks the daemon nothing, and the bytes are
the source's. Real mounts over nginx (--no-warm: nothing is cached while indexing).
"""

from __future__ import annotations

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

from shardfs.devtools.pagecache import resident_pages
from tests.conftest import Dataset, Mounter, brace
from tests.faultproxy import FaultProxy
from tests.fusefd import abort_connection
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


@pytest.mark.parametrize(("push", "workers", "loop", "listing"),
                         [("auto", "2", "c", "pusher"), ("auto", "1", "c", "pusher"),
                          ("off", "2", "c", "pusher"), ("auto", "1", "python", "pusher"),
                          ("auto", "1", "c-linger", "never"), ("auto", "2", "c", "loader"),
                          ("auto", "1", "c", "loader"), ("auto", "1", "python", "loader"),
                          ("auto", "2", "c", "never"), ("auto", "1", "python", "never")])
def test_files_of_an_arrived_shard_are_read_without_the_daemon(dataset: Dataset, nginx,
                                                               mounter: Mounter, push: str,
                                                               workers: str, loop: str,
                                                               listing: str, monkeypatch):
    """With workers the daemon pushes while workers answer READs; with one process a thread
    of the daemon pushes while its loop answers them. A file needs a kernel inode to be
    pushed into. `listing` "loader": the tree is listed first, as ImageFolder does, and while
    pages are pushed listings give the kernel every file's inode (SHARDFS_READDIRPLUS's
    "pushing"): the pusher looks nothing up. "pusher": nothing has listed or looked the files
    up, so the pusher has their directory listed (by its lookup process), once. "never"
    (SHARDFS_READDIRPLUS=never): listings give no inodes, and the pusher looks each file up.
    Each way, the file read before its shard arrived is not pushed (with workers, its READ
    was a worker's: the marks are shared). The pushing loop is the shim's (C), or the Python
    one it replaced where the shim does not answer metadata (SHARDFS_PUSH_IN_PYTHON makes it
    the Python one). "c-linger": the shim lingers for the next request (SHARDFS_LINGER_US,
    docs/pyfuse3.md) while the pusher's LOOKUPs and the reads come."""
    if listing == "never":
        monkeypatch.setenv("SHARDFS_READDIRPLUS", "never")
    if os.environ.get("SHARDFS_NO_SHIM") and (push == "auto" or loop != "python"):
        pytest.skip("pages are pushed only with the shim (no OPEN), the C loop needs it too")
    if loop == "python":
        monkeypatch.setenv("SHARDFS_PUSH_IN_PYTHON", "1")
    if loop == "c-linger":
        monkeypatch.setenv("SHARDFS_LINGER_US", "300")
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--push-pages", push, "--workers", workers)
    shard = max(sorted(dataset.shard_dir.glob("*.tar")), key=lambda p: len(members(p)))
    paths = [m.mountpoint / name for name in members(shard)]
    first, rest = paths[0], paths[1:]
    assert len(rest) >= 3
    if listing == "loader":
        assert sum(len(files) for _, _, files in os.walk(m.mountpoint)) == len(dataset.files())

    def source(path: Path) -> bytes:
        return (dataset.root / path.relative_to(m.mountpoint)).read_bytes()

    assert first.read_bytes() == source(first)  # starts the shard's whole fetch
    wait_for(lambda: m.stats()["shards_cached"] >= 1, f"{shard.name} never arrived")
    if push == "auto":
        wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "nothing pushed")
        pushed = m.stats()["pages_pushed"]
        # `first` was opened (and read): not pushed again; every other file was.
        assert pushed["opened"] == 1 and pushed["unknown"] == pushed["errors"] == 0, pushed
        assert pushed["files"] == len(rest), pushed
        assert pushed["looked_up"] == (len(rest) if listing == "never" else 0), pushed
        assert pushed["listed"] == (0 if listing == "never" else len(rest)), pushed
        assert (pushed["dirs_listed"] > 0) == (listing == "pusher"), pushed
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
    if os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("pages are pushed only with the shim (no OPEN)")
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
        # The pusher goes through an arrived shard in a thread of its own, after the commit
        # that `shards_cached` counts: read its stats once it has.
        wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "never went through it")
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


@pytest.mark.parametrize("loop", ["c", "python"])
def test_files_of_every_size_are_pushed_whole(nginx, mounter: Mounter, tmp_path: Path,
                                              loop: str, monkeypatch):
    """The C loop reads the cache file 256 KiB at a time for the files that follow (many in
    one read), a larger file piece by piece (4 MiB at most): files around both sizes, and
    small ones between them, are pushed byte for byte, and read with no READ reaching the
    daemon."""
    if os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("pages are pushed only with the shim (no OPEN)")
    if loop == "python":
        monkeypatch.setenv("SHARDFS_PUSH_IN_PYTHON", "1")
    sizes = [1, 700, 3000, (256 << 10) - 1, 256 << 10, (256 << 10) + 1, 5000,
             (4 << 20) + 12345, 100, (9 << 20) + 1, 40_000, 512, 513]
    files = {f"d/f{i:02d}.bin": os.urandom(size) for i, size in enumerate(sizes)}
    (nginx.root / "mixed").mkdir()
    with tarfile.open(nginx.root / "mixed" / "mixed-000000.tar", "w") as tar:
        info = tarfile.TarInfo("d/first.txt")  # read first: starts the whole download
        info.size = 6
        tar.addfile(info, io.BytesIO(b"first\n"))
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    m = mounter.mount([f"{nginx.url}/mixed/mixed-000000.tar"], None, None, "--no-warm",
                      "--push-pages", "auto")
    assert (m.mountpoint / "d/first.txt").read_bytes() == b"first\n"
    wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "nothing pushed")
    pushed = m.stats()["pages_pushed"]
    assert pushed["files"] == len(files) and pushed["bytes"] == sum(sizes), pushed
    assert pushed["unknown"] == pushed["errors"] == 0 and pushed["in_c"] == (loop == "c")
    before = m.stats()["reader"]["reads"]
    for name, data in files.items():
        resident, pages = resident_pages(m.mountpoint / name)
        assert (m.mountpoint / name).read_bytes() == data, name
        if resident == pages:  # (a page the kernel reclaimed meanwhile is read again)
            assert m.stats()["reader"]["reads"] == before, name
        before = m.stats()["reader"]["reads"]


def write_small_file_shards(where: Path, shards: int, per_shard: int) -> None:
    """Shards of many tiny files (`d<s>/f<i>.txt`): a push of one is thousands of lookups."""
    where.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(where / f"small-{s:06d}.tar", "w") as tar:
            for i in range(per_shard):
                data = f"shard {s} file {i}\n".encode()
                info = tarfile.TarInfo(f"d{s}/f{i:05d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def live_threads(pid: int) -> list[str]:
    """`tid:state` of the process's threads that have not exited. A killed process can keep
    one (in D state, waiting on a FUSE request) while its main thread is a zombie."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    live = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in "ZX":
            live.append(f"{tid}:{state}")
    return live


def children_of(pid: int) -> list[int]:
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            children += [int(c) for c in f.read().split()]
    return children


def wait_ended(pid: int, what: str, timeout: float = 20.0) -> None:
    """Until every thread of the process has exited."""
    deadline = time.monotonic() + timeout
    while live := live_threads(pid):
        assert time.monotonic() < deadline, f"{what} lingers: {live}"
        time.sleep(0.02)


def start_pushes(m, shards: int) -> dict:
    """Read each shard's first file (its whole download follows) and wait for the first
    pushes' lookups: the `pages_pushed` stats then."""
    for s in range(shards):
        assert (m.mountpoint / f"d{s}/f00000.txt").read_bytes() == f"shard {s} file 0\n".encode()
    deadline = time.monotonic() + 30
    while (pushed := m.stats()["pages_pushed"])["looked_up"] == 0:
        assert time.monotonic() < deadline, f"nothing pushed: {pushed}"
        time.sleep(0.002)
    return pushed


def waiting_on_a_mount(pid: int) -> bool:
    """Whether a thread of the process waits for the answer to a FUSE request it made (its
    kernel stack, /proc/PID/task/TID/stack: root only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stack = Path(f"/proc/{pid}/task/{tid}/stack").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "request_wait_answer" in stack or "fuse_simple_request" in stack:
            return True
    return False


def stats_fail(mountpoint: Path, timeout: float) -> OSError | None:
    """The error reading the mount's stats (a request only the daemon answers) ends with
    within `timeout` s (None: it succeeded, or still waits)."""
    outcome: list[OSError | None] = [None]

    def read() -> None:
        try:
            os.getxattr(mountpoint, "user.shardfs.stats")
        except OSError as exc:
            outcome[0] = exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return None if reader.is_alive() else outcome[0]


@pytest.mark.parametrize("loop", ["c", "python"])
def test_a_daemon_serving_alone_killed_mid_push_ends(nginx, mounter: Mounter, tmp_path: Path,
                                                     loop: str, monkeypatch):
    """The pusher's lookups are stats through the mount. Made by a thread of a daemon serving
    alone (--workers 1), a lookup that SIGKILL catches read by its reader thread and not yet
    answered keeps that thread waiting forever (without interruption): the process never
    ends, its /dev/fuse stays open, and the mount's readers hang until someone aborts the
    connection. Made by the lookup process, the killed daemon ends whatever it was doing,
    the connection with it (--no-holder: nobody takes over), and so does the lookup process.

    The kill's window is a few microseconds per lookup (too rare to catch in a test run), so
    the cause is watched for directly first: while thousands of lookups go on, no thread of
    the daemon ever waits for an answer from a FUSE mount (its kernel stacks, sampled), while
    the lookup process is seen doing so (the sampling sees such waits). Then it is killed
    mid-push, three times. Listings give no inodes here (SHARDFS_READDIRPLUS=never), so the
    pusher looks up each of the 9,000 files: the long window this needs (where listings give
    inodes, the pusher's directory listings are the lookup process's requests too, one per
    directory)."""
    monkeypatch.setenv("SHARDFS_READDIRPLUS", "never")
    if os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("pages are pushed only with the shim (no OPEN)")
    if loop == "python":
        monkeypatch.setenv("SHARDFS_PUSH_IN_PYTHON", "1")
    try:
        Path("/proc/self/stack").read_text()
    except OSError:
        pytest.skip("kernel stacks are not readable here (root and CONFIG_STACKTRACE needed)")
    shards, per_shard = 3, 3000
    write_small_file_shards(nginx.root / "small", shards, per_shard)
    pattern = f"{nginx.url}/small/small-{{000000..{shards - 1:06d}}}.tar"
    caught = 0
    for cycle in range(4):
        mnt = tmp_path / f"killed-mnt{cycle}"
        mnt.mkdir()
        killed = False
        m = mounter.mount([pattern], mnt, tmp_path / f"killed-cache{cycle}", "--no-warm",
                          "--workers", "1", "--no-holder", "--push-pages", "auto")
        try:
            pushed = start_pushes(m, shards)
            lookup_process = children_of(m.pid)
            if cycle == 0:  # watched until the push ends
                samples = seen_waiting = 0
                total = shards * per_shard
                deadline = time.monotonic() + 30
                while (now := m.stats()["pages_pushed"])["looked_up"] + now["opened"] < total:
                    for _ in range(20):
                        assert not waiting_on_a_mount(m.pid), "the daemon made a FUSE request"
                        seen_waiting += any(waiting_on_a_mount(p) for p in lookup_process)
                        samples += 1
                    assert time.monotonic() < deadline, f"the push did not end: {now}"
                assert seen_waiting, f"the lookup process never seen waiting ({samples} samples)"
                # It holds no descriptor of the connection (which must end with the daemon's)
                # and keeps no mount busy.
                (lookup,) = lookup_process
                held = [os.readlink(f"/proc/{lookup}/fd/{fd}")
                        for fd in os.listdir(f"/proc/{lookup}/fd")]
                assert "/dev/fuse" not in held and len(held) <= 3, held
                assert os.readlink(f"/proc/{lookup}/cwd") == "/"
            else:  # killed mid-push
                caught += pushed["looked_up"] < shards * (per_shard - 1)
            assert len(lookup_process) == 1, lookup_process
            os.kill(m.pid, signal.SIGKILL)
            killed = True
            wait_ended(m.pid, "the killed daemon")
            assert isinstance(stats_fail(mnt, 20), OSError)  # ENOTCONN, not a hang
            wait_ended(lookup_process[0], "the lookup process")
        finally:
            if killed and live_threads(m.pid):
                abort_connection(mnt)  # what a user would have to do: nothing left hanging
    assert caught >= 1, "the kills did not catch the pushes' lookups going on"


def test_a_daemon_killed_mid_push_under_the_holder_is_taken_over(tmp_path: Path,
                                                                  mounter: Mounter,
                                                                  monkeypatch):
    """The same kill with the holder keeping the connection (the default): the killed daemon
    ends at once (none of its threads waits on the mount), the next daemon takes over and
    answers what the lookup process was waiting for, and that process ends; every file reads
    right afterwards. One lookup per file, as above (SHARDFS_READDIRPLUS=never)."""
    monkeypatch.setenv("SHARDFS_READDIRPLUS", "never")
    if os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("takeovers and page push need the shim")
    shards, per_shard = 3, 3000
    write_small_file_shards(tmp_path / "small", shards, per_shard)
    pattern = f"file://{tmp_path}/small/small-{{000000..{shards - 1:06d}}}.tar"
    m = mounter.mount([pattern], None, None, "--no-warm", "--workers", "1")
    assert m.stats()["connection_kept_by"] == "holder", m.stats()
    pushed = start_pushes(m, shards)
    (lookup,) = children_of(m.pid)
    os.kill(m.pid, signal.SIGKILL)
    wait_ended(m.pid, "the killed daemon")
    wait_for(lambda: m.stats()["pid"] != m.pid, "no daemon took over")  # the stats wait for it
    assert m.stats()["takeovers"] == 1, m.stats()
    wait_ended(lookup, "the old lookup process")
    for s in range(shards):
        for i in range(per_shard):
            path = m.mountpoint / f"d{s}/f{i:05d}.txt"
            assert path.read_bytes() == f"shard {s} file {i}\n".encode(), path
    assert pushed["looked_up"] < shards * (per_shard - 1), "the kill came after the pushes"


def test_a_lookup_process_that_dies_turns_the_push_off(tmp_path: Path, mounter: Mounter):
    """Its socket ends (EPIPE or ECONNRESET): the daemon says so once, pushes no more, and
    serves every file as without pushes."""
    if os.environ.get("SHARDFS_NO_SHIM"):
        pytest.skip("page push needs the shim")
    shards, per_shard = 3, 300
    write_small_file_shards(tmp_path / "small", shards, per_shard)
    pattern = f"file://{tmp_path}/small/small-{{000000..{shards - 1:06d}}}.tar"
    m = mounter.mount([pattern], None, None, "--no-warm", "--workers", "1", "--no-holder")
    assert (m.mountpoint / "d0/f00000.txt").read_bytes() == b"shard 0 file 0\n"
    wait_for(lambda: m.stats()["pages_pushed"]["shards"] >= 1, "shard 0 never pushed")
    (lookup,) = children_of(m.pid)
    os.kill(lookup, signal.SIGKILL)
    wait_ended(lookup, "the killed lookup process")
    before = m.stats()["pages_pushed"]
    for s in (1, 2):  # their downloads complete after the lookup process is gone
        assert (m.mountpoint / f"d{s}/f00000.txt").read_bytes() == f"shard {s} file 0\n".encode()
    wait_for(lambda: m.stats()["shards_cached"] == shards, "the shards never arrived")
    wait_for(lambda: "lookup process ended: pushing pages is off" in m.log(), "no log line")
    after = m.stats()["pages_pushed"]
    assert after["files"] == before["files"] and after["errors"] >= 1, (before, after)
    for s in range(shards):
        for i in range(per_shard):
            path = m.mountpoint / f"d{s}/f{i:05d}.txt"
            assert path.read_bytes() == f"shard {s} file {i}\n".encode(), path
