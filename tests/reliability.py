"""Helpers shared by the reliability suites (faults, crashes, hostile shards, soak; issue #7).

- `make_dataset`: random-byte files of spread-out sizes packed into shards, with the sha256 of
  every file (the ground truth every read through a mount is checked against).
- `read_all`: read every file of a mount concurrently and check each one's sha256; every error
  and every wrong byte is counted, never raised from a worker thread.
- `effective_faults`: how many requests FaultProxy actually damaged.
- `report`: record one scenario's numbers; pytest prints them all with totals at the end of
  the run, and appends them as JSON to $SHARDFS_RELIABILITY_LOG when set (see
  docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shardfs.devtools.pagecache import drop_pages
from shardfs.pack import PackResult, pack
from tests.faultproxy import FaultProxy


@dataclass
class RandomDataset:
    root: Path  # the loose tree
    shard_dir: Path
    shards: PackResult
    sha: dict[str, str]  # relative path -> sha256 of its bytes
    sizes: dict[str, int]

    @property
    def names(self) -> list[str]:
        return [s.path.name for s in self.shards.shards]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def pattern(self, base: str) -> str:
        n = len(self.shards.shards)
        return f"{base}/train-{{000000..{n - 1:06d}}}.tar"

    def publish(self, dest: Path) -> Path:
        """Copy the shards (not their index files) to `dest`, e.g. an nginx root."""
        dest.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            shutil.copy(self.shard_dir / name, dest / name)
        return dest

    def files_of_shard(self, i: int) -> list[str]:
        return [name for name, _, _, _ in self.shards.shards[i].members]


def make_dataset(base: Path, *, files: int, mean_kb: float, shard_kb: int, seed: int,
                 big_every: int = 0, big_kb: int = 0) -> RandomDataset:
    """`files` random files in 8 class directories, log-normal sizes around `mean_kb`
    (every `big_every`-th one `big_kb` instead), packed into shards of about `shard_kb`."""
    rng = random.Random(seed)
    root = base / "tree"
    sha: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for i in range(files):
        kb = big_kb if big_every and i % big_every == big_every - 1 else \
            min(mean_kb * 6, rng.lognormvariate(0, 0.8) * mean_kb)
        size = 0 if i == 0 else max(1, int(kb * 1024))
        rel = f"train/c{i % 8}/f{i:05d}.bin"
        data = rng.randbytes(size)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        sha[rel] = hashlib.sha256(data).hexdigest()
        sizes[rel] = size
    shard_dir = base / "shards"
    result = pack(root, shard_dir, prefix="train", shard_size=shard_kb * 1024, shuffle=True,
                  seed=seed)
    return RandomDataset(root, shard_dir, result, sha, sizes)


@dataclass
class ReadResult:
    files: int = 0  # files read to the end and found equal to the source
    bytes_verified: int = 0
    wrong: list[str] = field(default_factory=list)  # read fine, bytes differ: never allowed
    errors: dict[str, int] = field(default_factory=dict)  # path -> errno
    seconds: float = 0.0

    def merge(self, other: ReadResult) -> None:
        self.files += other.files
        self.bytes_verified += other.bytes_verified
        self.wrong += other.wrong
        self.errors.update(other.errors)
        self.seconds += other.seconds


def read_file(path: Path, chunk: int = 64 * 1024) -> tuple[str, int]:
    digest = hashlib.sha256()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while data := f.read(chunk):
            digest.update(data)
            n += len(data)
    return digest.hexdigest(), n


def read_uncached(path: Path) -> tuple[str, int]:
    """read_file past the kernel's page cache (a mount keeps file pages across opens, so a
    repeated read would otherwise not reach the daemon; a dataset larger than RAM behaves
    like this)."""
    drop_pages(path)
    return read_file(path)


def read_all(mnt: Path, expected: dict[str, str], *, threads: int = 8, seed: int = 0,
             names: Iterable[str] | None = None, timeout: float = 120.0) -> ReadResult:
    """Read `names` (default: every file) in a shuffled order with `threads` readers."""
    todo = list(expected if names is None else names)
    random.Random(seed).shuffle(todo)
    result = ReadResult()
    lock = threading.Lock()

    def one(rel: str) -> None:
        try:
            got, n = read_file(mnt / rel)
        except OSError as exc:
            with lock:
                result.errors[rel] = exc.errno or -1
            return
        with lock:
            if got == expected[rel]:
                result.files += 1
                result.bytes_verified += n
            else:
                result.wrong.append(rel)

    began = time.monotonic()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="reader")
    try:
        futures = [pool.submit(one, rel) for rel in todo]
        for fut in futures:
            fut.result(timeout=max(0.1, began + timeout - time.monotonic()))
    finally:
        # A reader stuck in the kernel would block shutdown(wait=True); the mount's teardown
        # (fusermount -u -z, then SIGKILL) frees it.
        pool.shutdown(wait=False, cancel_futures=True)
    result.seconds = time.monotonic() - began
    return result


_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def effective_faults(proxy: FaultProxy) -> int:
    """Requests the proxy actually damaged: a cut or mid-body stall only counts when the
    response was longer than the point where it strikes."""
    count = 0
    for req in proxy.requests:
        fault = req.fault
        if fault is None:
            continue
        if fault.status is not None or (fault.stall_s and fault.stall_after is None):
            count += 1
            continue
        mark = fault.reset_after if fault.reset_after is not None else fault.truncate_after
        if mark is None:
            mark = fault.stall_after
        m = _RANGE.fullmatch(req.headers.get("range", ""))
        length = int(m.group(2)) - int(m.group(1)) + 1 if m else None
        if mark is not None and (length is None or length > mark):
            count += 1
    return count


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def daemon_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")



def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    """Poll `cond` every 50 ms until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (ESRCH: it ended while we read)
        return False


class _Summary:
    """A pytest plugin, registered on the first report: prints all scenarios and totals."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        tr.section("reliability summary (issue #7)")
        totals: dict[str, float] = {}
        for row in self.rows:
            tr.write_line(f"{row['scenario']}: " + "  ".join(
                f"{k}={v}" for k, v in row.items() if k != "scenario"))
            for k, v in row.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    totals[k] = totals.get(k, 0) + v
        tr.write_line(f"scenarios: {len(self.rows)}  totals: " + "  ".join(
            f"{k}={round(v, 1) if isinstance(v, float) else v}"
            for k, v in sorted(totals.items())))


def report(request, scenario: str, **numbers: object) -> None:
    """Record one scenario's numbers: shown at the end of the run (even without `-s`),
    and appended as JSON to $SHARDFS_RELIABILITY_LOG when that is set."""
    config = request.config
    plugin = config.pluginmanager.get_plugin("shardfs-reliability")
    if plugin is None:
        plugin = _Summary()
        config.pluginmanager.register(plugin, "shardfs-reliability")
    row = {"scenario": scenario, **numbers}
    plugin.rows.append(row)
    log = os.environ.get("SHARDFS_RELIABILITY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")
