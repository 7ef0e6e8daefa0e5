"""Keep Python's cyclic garbage collector off the objects a serving process made at start.

A daemon holds many long-lived objects (the catalog's shards, pyfuse3's, httpx's and trio's
modules, ...). Each full collection (generation 2) walks every one of them: measured at ~16 ms
on the serving loop's thread, in the middle of a Lookahead announcement at an epoch's start
(docs/benchmarks-notes.md, "A Lookahead epoch's first 100 ms, and one serving process on 2
cores"). `gc.freeze()` moves what exists now into a permanent generation that collections
skip. What is made later is collected as before; frozen objects are still freed by reference
counting when dropped (only a cycle among them would stay), so this is called once a process
has built what it keeps.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how
    many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
