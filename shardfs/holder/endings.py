"""How a daemon ended, in words for the log: exit status, signal, and whether the kernel's OOM
killer did it (the cgroup's `memory.events` counts `oom_kill`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def cgroup_oom_kills() -> int | None:
    """`oom_kill` of this process's cgroup (v2; the daemon is in the same one), or None."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        path = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/")
        for entry in (path / "memory.events").read_text().splitlines():
            key, _, value = entry.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def describe(status: int, *, oom_kills_before: int | None) -> str:
    """A waitpid() status, e.g. "killed by SIGKILL (the OOM killer)" or "exited with status 1"."""
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        text = f"killed by {name}"
        if signum == signal.SIGKILL and oom_kills_before is not None:
            after = cgroup_oom_kills()
            if after is not None and after > oom_kills_before:
                text += " (the kernel's OOM killer: memory.events oom_kill rose)"
        if os.WCOREDUMP(status):
            text += ", core dumped"
        return text
    return f"ended with wait status {status}"
