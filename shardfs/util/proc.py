"""What /proc says about a process: CPU time used (for stats, `shardfs top`), whether it is
dying."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may hold spaces and ')': the fields start after its last ')'.
    return text[text.rfind(b")") + 2:].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (all its threads); None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS


def leader_exited(pid: int) -> bool:
    """The process's main thread has exited (state Z) while the process lingers: a shardfs
    daemon killed while one of its threads waits in a FUSE request that only the next daemon
    can answer (a request to its own mount: the page pusher's lookups were, before the lookup
    process made them). Such a process runs no more
    code of its own, but holds its descriptors (the cache dir's lock) until that request is
    answered."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] == b"Z"
