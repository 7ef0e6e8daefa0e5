"""What the mount's threads were doing, sample by sample, from kernel call graphs: `bench
cpusplit --profile kernel`.

`--profile perf` (no call graphs) says how much of a thread's time was kernel code, and which
kernel functions: `memcpy`, `_raw_spin_unlock_irqrestore`. It cannot say what they were
copying or for whom. With call graphs (`perf record -g`) each sample's kernel stack names the
system call or the interrupt it ran under, so a pass splits into what the mount pays for:
the download's splice into the cache file, the page push's stores, READ replies, reads of
cache files, and TCP work done in softirq. Over loopback that last one includes the *server's*
sending: the receiver's ACK, processed in its own context, lets the sender's socket transmit,
and the segments are received there too (docs/benchmarks-notes.md, "Where a cold HTTP file's
CPU goes, by what the kernel was doing"). On a real link the sender is another machine.

Python has no frame pointers here, so user stacks are cut short: a sample with no kernel
frame is "user" (Python, and C libraries called from it). Sampling every thread of the mount
with call graphs costs more than `--profile perf`; the pass's µs with it are not comparable.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

# (what, kernel functions any of which in a sample's stack means it), the first match wins:
# softirq first (it runs inside whatever system call it interrupted on the way out).
KINDS: list[tuple[str, frozenset[str]]] = [
    ("TCP in softirq", frozenset({"net_rx_action", "do_softirq.part.0", "__do_softirq",
                                  "handle_softirqs"})),
    ("splice into a file", frozenset({"iter_file_splice_write"})),
    ("splice from a socket", frozenset({"tcp_splice_read"})),
    # (a READ's reply and the page push's store alike: the store is inlined there; the
    # push's thread tells them apart)
    ("FUSE reply or store", frozenset({"fuse_dev_write", "fuse_dev_do_write"})),
    ("FUSE request read", frozenset({"fuse_dev_read", "fuse_dev_do_read"})),
    ("file read", frozenset({"filemap_read", "generic_file_read_iter"})),
    ("file write", frozenset({"generic_perform_write"})),
    ("socket send", frozenset({"tcp_sendmsg", "tcp_sendmsg_locked"})),
    ("socket receive", frozenset({"tcp_recvmsg", "tcp_recvmsg_locked"})),
]
SYSCALL_PREFIX = "__x64_sys_"


def kind_of(stack: list[str]) -> str:
    """What one sample was doing, from its stack's function names (leaf first)."""
    names = set(stack)
    for kind, marks in KINDS:
        if names & marks:
            return kind
    for name in stack:
        if name.startswith(SYSCALL_PREFIX):
            return "other system call: " + name[len(SYSCALL_PREFIX):]
    if any(name.startswith("asm_") for name in stack):
        return "interrupt or fault"
    return "user"


def parse_script(text: str) -> list[tuple[int, list[str]]]:
    """`perf script -F tid,ip,sym` output as (thread id, function names leaf first) per
    sample."""
    samples: list[tuple[int, list[str]]] = []
    tid: int | None = None
    stack: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            if tid is not None:
                samples.append((tid, stack))
            tid, stack = None, []
        elif tid is None and len(fields) == 1 and fields[0].isdigit():
            tid = int(fields[0])
        elif tid is not None and len(fields) >= 2:
            stack.append(fields[1])
    if tid is not None:
        samples.append((tid, stack))
    return samples


def kernel_split(path: Path, tid_group: dict[int, str]) -> dict[str, dict[str, float]]:
    """Per thread group, the % of all the mount's samples by what they were doing (kind_of);
    threads not in `tid_group` (ended before the pass did) as "(ended)"."""
    text = subprocess.run(["perf", "script", "-i", str(path), "-F", "tid,ip,sym"],
                          capture_output=True, text=True).stdout
    samples = parse_script(text)
    counts: Counter[tuple[str, str]] = Counter(
        (tid_group.get(tid, "(ended)"), kind_of(stack)) for tid, stack in samples)
    total = len(samples) or 1
    split: dict[str, dict[str, float]] = {}
    for (group, kind), n in counts.most_common():
        split.setdefault(group, {})[kind] = round(100 * n / total, 1)
    return split


def describe(split: dict[str, dict[str, float]], top: int = 6) -> str:
    """"group: kind 12.3%, ...; group: ..." with each group's `top` kinds, largest first."""
    return "; ".join(
        f"{group}: " + ", ".join(f"{kind} {pct:g}%" for kind, pct in list(kinds.items())[:top])
        for group, kinds in sorted(split.items(), key=lambda gk: -sum(gk[1].values())))
