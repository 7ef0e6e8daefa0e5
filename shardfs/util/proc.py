"""What /proc says about a process: CPU time used (for stats, `shardfs top`)."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (all its threads); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may hold spaces and ')': the fields start after its last ')'.
    fields = text[text.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS
