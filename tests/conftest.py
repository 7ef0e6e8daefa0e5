"""Shared fixtures: real nginx, real shards, real FUSE mounts that are always unmounted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The CSI tests' kubelet stand-in (tests/csi_node.py) runs gRPC in this process, which then
# starts readers, servers and daemons by fork and exec. grpcio 1.81+ restarts its poller in
# a forked child when fork support is on, and a child whose descriptors Popen closed before
# exec dies there (SIGABRT, "epoll_wait error: Bad file descriptor": grpc/grpc#43055). The
# tests fork no gRPC user, so fork support is turned off before gRPC is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from shardfs.devtools.datagen import make_imagefolder
from shardfs.pack import PackResult, pack
from tests.nginx_fixture import nginx  # noqa: F401  (re-exported fixture)

SHARDFS = [sys.executable, "-m", "shardfs"]


# Tests of what only the pyfuse3 shim provides (no OPEN, metadata and reads in C, worker
# processes) skip when it is turned off: `SHARDFS_NO_SHIM=1 python -m pytest` runs the rest of
# the suite on the path without it (docs/testing.md).
needs_shim = pytest.mark.skipif(bool(os.environ.get("SHARDFS_NO_SHIM")),
                                reason="needs the pyfuse3 shim (SHARDFS_NO_SHIM is set)")


def _mounted(path: str) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == path for line in f)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes; reap it if it is our child.
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: it ended while we read)
        return False


@dataclass
class Mount:
    """A running `shardfs mount` (daemonized through the real CLI)."""

    mountpoint: Path
    cache_dir: Path
    pid: int
    stdout: str
    stderr: str

    @classmethod
    def from_result(cls, result: subprocess.CompletedProcess, mountpoint: Path,
                    cache_dir: Path) -> Mount:
        """A mount made by a daemonizing `shardfs` command (its stdout names the daemon pid)."""
        match = re.search(r"daemon pid (\d+)", result.stdout)
        assert result.returncode == 0 and match, result.stdout + result.stderr
        return cls(mountpoint, cache_dir, int(match.group(1)), result.stdout, result.stderr)

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.mountpoint, "user.shardfs.stats"))

    def log(self) -> str:
        path = self.cache_dir / "shardfs.log"
        return path.read_text() if path.exists() else ""

    def unmount(self) -> None:
        if _mounted(str(self.mountpoint)):
            result = subprocess.run(["fusermount3", "-u", str(self.mountpoint)],
                                    capture_output=True, text=True)
            if result.returncode != 0:  # busy or stale: detach lazily so nothing is left
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                               capture_output=True)
        deadline = time.monotonic() + 10
        while _pid_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


class Mounter:
    """Starts mounts for a test and guarantees their teardown, also when the test fails."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[Mount] = []
        self._count = 0

    def paths(self) -> tuple[Path, Path]:
        self._count += 1
        mnt = self.tmp_path / f"mnt{self._count}"
        mnt.mkdir()
        return mnt, self.tmp_path / f"cache{self._count}"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run `shardfs mount ARGS` and return the result, whatever it is."""
        result = subprocess.run([*SHARDFS, "mount", *args], capture_output=True, text=True,
                                timeout=timeout)
        return result

    def mount(self, sources: list[str], mountpoint: Path | None = None,
              cache_dir: Path | None = None, *extra: str,
              in_place: str | None = "off") -> Mount:
        """`in_place`: "off" (the default here) copies file:// shards into the cache, so that
        the many tests which use local shards as a stand-in for a remote store exercise the
        fetch, check, push and eviction they are about; an `--in-place` in `extra` wins (the
        last flag counts); None leaves the product's default (auto: local shards read in
        place), and is what a test that sets it by `-o` or a config file must pass (a flag
        would override those)."""
        mnt, cache = self.paths()
        mountpoint = mountpoint or mnt
        cache_dir = cache_dir or cache
        chosen = ("--in-place", in_place) if in_place is not None else ()
        result = self.run(*sources, str(mountpoint), "--cache-dir", str(cache_dir),
                          "--log-level", "debug", *chosen, *extra)
        if result.returncode != 0:
            raise AssertionError(f"mount failed ({result.returncode}):\n{result.stderr}")
        return self.adopt(Mount.from_result(result, mountpoint, cache_dir))

    def adopt(self, m: Mount) -> Mount:
        """Take a mount made elsewhere (config file, mount(8) form) into teardown."""
        self.mounts.append(m)
        return m

    def cleanup(self) -> None:
        for m in self.mounts:
            m.unmount()


@pytest.fixture(scope="session", autouse=True)
def _no_wids_litter() -> Iterator[None]:
    """Importing wids (interop test, bench smoke test) creates /tmp/_wids_cache through a
    default argument; remove it again if this session made it and left it empty."""
    default_dir = Path("/tmp/_wids_cache")
    existed = default_dir.exists()
    yield
    if not existed and default_dir.is_dir() and not any(default_dir.iterdir()):
        default_dir.rmdir()


def stop_foreground(proc: subprocess.Popen, mountpoint: Path) -> None:
    """Teardown for a `shardfs mount -f` a test started: no process, no mount left."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if os.path.ismount(mountpoint):
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)])


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator[Mounter]:
    m = Mounter(tmp_path)
    try:
        yield m
    finally:
        m.cleanup()


@dataclass
class Dataset:
    root: Path  # the loose ImageFolder tree (root/train/<class>/<file>)
    shards: PackResult
    shard_dir: Path

    def files(self) -> dict[str, bytes]:
        out = {}
        for path in sorted(self.root.rglob("*")):
            if path.is_file():
                out[path.relative_to(self.root).as_posix()] = path.read_bytes()
        return out


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """A small ImageFolder of real JPEGs (6 classes x 20), packed into 8 shuffled shards."""
    base = tmp_path_factory.mktemp("dataset")
    root = base / "tree"
    make_imagefolder(root, classes=6, per_class=20, mean_kb=8, seed=1)
    shard_dir = base / "shards"
    result = pack(root, shard_dir, prefix="train", shard_size=128 * 1024, shuffle=True, seed=3)
    assert len(result.shards) >= 6, "the dataset should span several shards"
    return Dataset(root, result, shard_dir)


def shard_names(ds: Dataset) -> list[str]:
    return [s.path.name for s in ds.shards.shards]


def brace(ds: Dataset, base: str) -> str:
    """The brace pattern naming the dataset's shards under `base` (a URL or a directory)."""
    n = len(ds.shards.shards)
    return f"{base}/train-{{000000..{n - 1:06d}}}.tar"


@contextlib.contextmanager
def _test_file_system(kind: str, options: str, where: Path) -> Iterator[Path]:
    """A file system of type `kind` mounted at `where` for the test (skipped where it cannot
    be), lazily unmounted after it, also on failure."""
    made = subprocess.run(["mount", "-t", kind, "-o", options, kind, str(where)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of the test's own: a file system known to be local (util/fstypes.py)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    with _test_file_system("tmpfs", "size=64m", where):
        yield where


@pytest.fixture
def overlay(tmp_path: Path) -> Iterator[Path]:
    """An overlayfs of the test's own (what a container's own file system is), its lower and
    upper layers in the test's tmp dir: files written to it land in the upper layer."""
    where, layers = tmp_path / "overlay", tmp_path / "layers"
    for d in (where, layers / "lower", layers / "upper", layers / "work"):
        d.mkdir(parents=True)
    with _test_file_system("overlay", f"lowerdir={layers / 'lower'},upperdir={layers / 'upper'},"
                             f"workdir={layers / 'work'}", where):
        yield where


@dataclass
class LoopDisk:
    """An ext4 file system on a loop device of the test's own (`loop_disks`)."""

    path: Path  # where it is mounted
    device: str  # the kernel's name: loop3

    def set_rotational(self, spins: bool) -> None:
        """What the kernel tells of the disk (queue/rotational: writable by root)."""
        Path(f"/sys/block/{self.device}/queue/rotational").write_text("1" if spins else "0")


@pytest.fixture
def loop_disks(tmp_path: Path) -> Iterator[Callable[[str], LoopDisk]]:
    """Makes small ext4 file systems on loop devices (standing in for a machine's disks, one
    spinning, one not); skips where loop devices cannot be had. Unmounted and detached after
    the test (lazily: a mount's cache dir may still be on one while its teardown runs)."""
    made: list[tuple[Path, str]] = []

    def make(name: str) -> LoopDisk:
        image, where = tmp_path / f"{name}.img", tmp_path / name
        with open(image, "wb") as f:
            f.truncate(64 << 20)
        where.mkdir()
        attach = subprocess.run(["losetup", "--find", "--show", str(image)],
                                capture_output=True, text=True)
        if attach.returncode != 0:
            pytest.skip(f"no loop device here: {attach.stderr.strip()}")
        dev = attach.stdout.strip()
        made.append((where, dev))
        for cmd in (["mkfs.ext4", "-q", "-F", dev], ["mount", dev, str(where)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return LoopDisk(where, os.path.basename(dev))

    try:
        yield make
    finally:
        for where, dev in reversed(made):
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
            subprocess.run(["losetup", "-d", dev], capture_output=True)


def scrape_metrics(port: int) -> dict[str, float]:
    """A mount's Prometheus metrics (--metrics-listen), by name."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("shardfs_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
