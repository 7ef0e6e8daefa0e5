"""What a new page of page cache costs this machine, as a yardstick for CPU per file.

A cold file read through a copying mount moves its bytes into pages that were just allocated
(the cache file's, then the mount's own), and on a VM the price of such a page changes from
one sitting to the next: free memory the guest has handed back to its host (free page
reporting) faults on the host at its next first touch (docs/benchmarks-notes.md, "What a new
page costs: the sittings explained"). This writes `mb` MiB into a new file's page cache and
then over the same pages again, and reports the CPU each pass took, so that two runs' µs per
file can be read against what memory cost in each.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from bench.procs import own_cpu_s

PIECE = 1 << 20


def _write_pass(fd: int, piece: bytes, mb: int) -> float:
    start = own_cpu_s()
    for i in range(mb):
        os.pwrite(fd, piece, i * PIECE)
    return max(own_cpu_s() - start, 1e-9)


def page_cost(where: Path, mb: int = 2048) -> dict:
    """CPU per 4 KiB page and GB/s of CPU for writing `mb` MiB into new page-cache pages of a
    file under `where`, and for writing them again (pages that exist): the ratio of the two is
    what a new page adds. More than a pass allocates: on this project's VM the first few
    hundred MB after `drop_caches` are pages just freed and cost ~1 µs each, those past them
    7-14 µs (docs/benchmarks-notes.md), and a copying pass over 506 MB takes ~1.5 GB."""
    piece = b"\x5a" * PIECE
    fd, name = tempfile.mkstemp(prefix="shardfs-pagecost-", dir=where)
    try:
        new = _write_pass(fd, piece, mb)
        again = _write_pass(fd, piece, mb)
    finally:
        os.close(fd)
        os.unlink(name)
    pages = mb * PIECE / 4096
    return {"mb": mb,
            "new_us_per_page": round(new / pages * 1e6, 3),
            "new_gb_per_cpu_s": round(mb * PIECE / new / 1e9, 2),
            "again_us_per_page": round(again / pages * 1e6, 3),
            "again_gb_per_cpu_s": round(mb * PIECE / again / 1e9, 2)}


def describe(cost: dict) -> str:
    return (f"new page-cache pages {cost['new_gb_per_cpu_s']} GB per CPU s "
            f"({cost['new_us_per_page']} µs a page), the same pages again "
            f"{cost['again_gb_per_cpu_s']} GB/s")


def note_page_cost(record: dict, when: str, where: Path) -> None:
    """Price a new page now (the caller dropped the page cache just before) into
    record["page_cost"][when], and print it."""
    cost = page_cost(where)
    record.setdefault("page_cost", {})[when] = cost
    print(f"  page cost at the {when}: {describe(cost)}", flush=True)


def page_cost_lines(record: dict) -> list[str]:
    """The rendered table's note on what memory cost at the run's start and end."""
    cost = record.get("page_cost")
    if not cost or "start" not in cost or "end" not in cost:
        return []
    return ["", "This sitting's price of memory (bench/pagecost.py, after `drop_caches`): at "
            f"the start {describe(cost['start'])}; at the end {describe(cost['end'])}. Copied "
            "passes copy each byte into new pages twice (the cache file's, the mount's), in "
            "place and dropped once: compare µs per file between runs only where these agree."]
