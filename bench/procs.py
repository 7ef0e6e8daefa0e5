"""Process and mount helpers: everything is cleaned up by mountpoint or by our own pids."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

from shardfs.devtools.pagecache import drop_pages

CLK_TCK = os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """This process's CPU seconds so far, user + system (its threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def is_mounted(path: Path | str) -> bool:
    target = os.path.abspath(path)
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1] == target for line in f)
    except OSError:
        return False


def wait_mounted(path: Path, proc: subprocess.Popen | None, timeout: float) -> None:
    """Until `path` is a mountpoint; RuntimeError if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_mounted(path):
            # The mount table entry appears at INIT; a first stat proves the daemon answers.
            os.stat(path)
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with status {proc.returncode} before mounting")
        time.sleep(0.05)
    raise RuntimeError(f"not mounted after {timeout:g} s")


def unmount(path: Path) -> str | None:
    """fusermount3 -u (retried while busy, then lazily); returns an error note or None."""
    note = None
    for attempt in range(20):
        if not is_mounted(path):
            return note
        result = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True)
        if result.returncode == 0:
            return note
        note = result.stderr.strip()
        time.sleep(0.1 * (attempt + 1) if attempt < 5 else 0.5)
    subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)
    return f"lazy unmount after: {note}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """Wait for our own process `pid` to exit (after an unmount), then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if not pid_alive(pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def interrupt(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGINT a recording tool (perf, py-spy) so that it writes out, and wait for it; killed
    if it has not ended within `timeout` s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads) from /proc/PID/stat."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, IndexError):
        return None
    # After "pid (comm) ": state is field 3, so utime (14) and stime (15) are at 11 and 12.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def peak_rss(pid: int | None, field: str = "VmHWM") -> int | None:
    """VmHWM (peak resident set size; or another field, e.g. VmRSS) in bytes, from
    /proc/PID/status."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


def drop_from_page_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) every file under root, so a 'cold' local read hits the disk
    (works unprivileged, unlike /proc/sys/vm/drop_caches). Returns the files touched."""
    n = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                drop_pages(os.path.join(dirpath, name))
            except OSError:
                continue
            n += 1
    return n
