"""System calls of the mount's processes over one pass, counted by `perf stat` (Debian
linux-perf) on the kernel's `syscalls:sys_enter_*` tracepoints: `bench cpusplit --profile
syscalls`.

Why: on this VM the CPU a pass costs swings from sitting to sitting (docs/benchmarks-notes.md,
"What a new page costs"), while how many calls the mount makes per file does not. A change
that removes calls (the page push's zero-length stores, `pread` per pushed file) shows here
in one run, whatever the sitting (docs/benchmarks-notes.md, "Bytes and calls counted, not only
timed"). Counting is cheap (tracepoint counters, no samples); threads started during the pass
(trio's workers) are counted too (perf's counters are inherited).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from bench.procs import interrupt

EVENT_PREFIX = "syscalls:sys_enter_"


class SyscallCount:
    """`perf stat` counting the system calls of `pids` until `stop`: every kind, or those
    named in `calls`. Opening the ~360 counters takes perf ~0.05 s; closing them at `stop`
    ~13 s (the kernel unregisters each tracepoint), after the pass."""

    def __init__(self, pids: list[int], path: Path, calls: list[str] | None = None) -> None:
        self.path = path
        events = ",".join(EVENT_PREFIX + c for c in calls) if calls else EVENT_PREFIX + "*"
        self.proc = subprocess.Popen(
            ["perf", "stat", "-x", ",", "-o", str(path), "-e", events,
             "-p", ",".join(map(str, pids))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches

    def stop(self) -> dict[str, int]:
        """The calls counted, by name, most first (empty if perf could not count)."""
        interrupt(self.proc)
        try:
            text = self.path.read_text()
        except OSError:
            return {}
        finally:
            self.path.unlink(missing_ok=True)
        return parse_perf_stat(text)


def parse_perf_stat(text: str) -> dict[str, int]:
    """`perf stat -x ,` output (count,unit,event,...) as {system call: count}, most first;
    calls not made left out."""
    counts = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) < 3 or not fields[2].startswith(EVENT_PREFIX):
            continue
        try:
            count = int(fields[0])
        except ValueError:  # "<not counted>", "<not supported>"
            continue
        if count:
            counts[fields[2][len(EVENT_PREFIX):]] = count
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def per_file(counts: dict[str, int], files: int, top: int = 10) -> str:
    """The `top` calls per file read, and all of them: "writev 1.00, ... (all 3.21)"."""
    if not counts or files <= 0:
        return "–"
    shown = ", ".join(f"{name} {n / files:.2f}" for name, n in list(counts.items())[:top])
    return f"{shown} (all {sum(counts.values()) / files:.2f})"
