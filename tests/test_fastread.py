"""The collection of the reads the shim answered in C (shardfs/fuse/fastread.py): C counts
each read in the shard's arrays and lists a shard when its counts leave zero; `collect`
visits the listed shards, or every open one when C found its list full. A mount reaches
the full list only when shards are closed and read again more times than there are shards
within one 10 ms collection, so the arrays are set here as C leaves them."""

from __future__ import annotations

from pathlib import Path

from shardfs.fuse.fastread import FastReads
from shardfs.read.states import ShardStates

SHARDS = 4


def reads_as_c_left_them(tmp_path: Path) -> FastReads:
    fast = FastReads(ShardStates(SHARDS), tmp_path, [f"shard-{s}" for s in range(SHARDS)])
    fast._open.update(range(SHARDS))  # descriptors as `offer` leaves them (none needed here)
    fast.complete[1], fast.frontier[2], fast.complete[3] = 3, 2, 1
    fast.nbytes[0] = 6 * 1000
    return fast


def test_a_full_list_makes_the_collection_visit_every_open_shard(tmp_path: Path):
    fast = reads_as_c_left_them(tmp_path)
    # Shard 1 was listed, its counts taken by `close_stale`, then read again, until the
    # list was full; shards 2 and 3 were read after that and are not listed.
    for i in range(SHARDS):
        fast.touched[i] = 1
    fast.touched_len[0], fast.touched_len[1] = SHARDS, 1
    got = fast.collect()
    assert sorted(got.shards) == [1, 1, 1, 2, 2, 3]
    assert (got.complete, got.frontier, got.nbytes) == (4, 2, 6000)
    assert list(fast.touched_len) == [0, 0]
    assert not any(fast.complete) and not any(fast.frontier)
    assert fast.collect().shards == []


def test_a_shard_listed_twice_is_counted_once(tmp_path: Path):
    fast = reads_as_c_left_them(tmp_path)
    for i, shard in enumerate((1, 2, 1, 3)):
        fast.touched[i] = shard
    fast.touched_len[0] = 4
    got = fast.collect()
    assert sorted(got.shards) == [1, 1, 1, 2, 2, 3]
    assert (got.complete, got.frontier) == (4, 2)
