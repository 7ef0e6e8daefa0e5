"""ShardAwareSampler and DistributedShardSampler: permutations, equal lengths, determinism,
locality, and learning the shard of each file from a real mount."""

from __future__ import annotations

import random
import warnings
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset  # noqa: E402

import shardfs.torch.shardmap as st_mod  # noqa: E402
from shardfs.torch import (  # noqa: E402
    DistributedShardSampler,
    ShardAwareSampler,
    ShardMap,
    fitting_window,
    mount_stats,
    sample_paths,
    shard_map,
)
from tests.conftest import Mounter, brace  # noqa: E402


class FakeDataset:
    """Only a length: the samplers need nothing else when given a shard map."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def make_map(sizes: list[int], seed: int = 0, unknown: int = 0) -> ShardMap:
    """Shards of the given sizes with their samples scattered over the index space (as
    `pack --shuffle` does), plus `unknown` samples that are not on a mount."""
    urls: list[str | None] = [f"http://h/s-{k:03d}.tar" for k, n in enumerate(sizes)
                              for _ in range(n)]
    urls += [None] * unknown
    random.Random(seed).shuffle(urls)
    return ShardMap.from_urls(urls)


def runs(order: list[int], m: ShardMap) -> int:
    """How many times the sequence switches to another shard (+1)."""
    shards = [int(m.shard_of[i]) for i in order]
    return sum(1 for a, b in zip([None, *shards], shards, strict=False) if a != b)


def max_open(order: list[int], m: ShardMap) -> int:
    """Most shards 'in flight' at once: between their first and last sample."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, i in enumerate(order):
        k = int(m.shard_of[i])
        first.setdefault(k, pos)
        last[k] = pos
    events = sorted([(p, 1) for p in first.values()] + [(p + 0.5, -1) for p in last.values()])
    now = best = 0
    for _, delta in events:
        now += delta
        best = max(best, now)
    return best


SIZES = [17, 5, 30, 22, 9, 14, 26, 11, 3, 19, 24, 8, 16]  # 204 samples in 13 uneven shards


# -- ShardAwareSampler ------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 100])
def test_each_epoch_is_a_permutation(window: int):
    m = make_map(SIZES)
    s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m, window=window)
    assert len(s) == sum(SIZES)
    for epoch in range(4):
        s.set_epoch(epoch)
        assert sorted(s) == list(range(len(m)))


def test_deterministic_per_seed_and_epoch_and_different_across_epochs():
    m = make_map(SIZES)

    def order(seed: int, epoch: int) -> list[int]:
        s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    assert order(0, 0) == order(0, 0)
    assert order(7, 3) == order(7, 3)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    # Shard order changes between epochs too, not only the order inside shards.
    firsts = {int(m.shard_of[order(0, e)[0]]) for e in range(8)}
    assert len(firsts) > 1


def test_without_set_epoch_each_iteration_is_a_new_order():
    m = make_map(SIZES)
    s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m)
    assert list(s) != list(s)


def test_locality_window_one_reads_each_shard_once():
    m = make_map(SIZES)
    s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m, window=1)
    for epoch in range(3):
        s.set_epoch(epoch)
        assert runs(list(s), m) == len(SIZES)


@pytest.mark.parametrize("window", [2, 4])
def test_locality_window_bounds_shards_in_flight(window: int):
    m = make_map(SIZES)
    s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m, window=window)
    g = torch.Generator().manual_seed(0)
    stock = list(torch.utils.data.RandomSampler(FakeDataset(len(m)), generator=g))
    assert max_open(stock, m) >= len(SIZES) - 2  # uniform order keeps ~every shard in use
    for epoch in range(3):
        s.set_epoch(epoch)
        assert max_open(list(s), m) <= window


def test_shuffle_false_is_grouped_by_shard_in_dataset_order():
    m = make_map(SIZES)
    order = list(ShardAwareSampler(FakeDataset(len(m)), shard_map=m, shuffle=False))
    assert sorted(order) == list(range(len(m)))
    assert runs(order, m) == len(SIZES)
    for k in range(len(SIZES)):
        mine = [i for i in order if int(m.shard_of[i]) == k]
        assert mine == sorted(mine)


def test_files_not_on_a_mount_fall_back_to_random_order_with_a_warning(tmp_path: Path):
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(10):
            (tmp_path / c / f"{i}.png").write_bytes(b"x")
    ds = datasets.ImageFolder(str(tmp_path), loader=lambda p: p)
    with pytest.warns(UserWarning, match="not on a shardfs mount"):
        s = ShardAwareSampler(ds, map_cache=tmp_path / "maps")
    assert not list((tmp_path / "maps").glob("*.map"))  # nothing worth caching
    orders = [list(s) for _ in range(3)]
    assert all(sorted(o) == list(range(20)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3


def test_partly_unknown_files_are_still_covered():
    m = make_map(SIZES, unknown=25)
    with pytest.warns(UserWarning, match="25 of 229"):
        s = ShardAwareSampler(FakeDataset(len(m)), shard_map=m, window=2)
    assert sorted(s) == list(range(len(m)))


def test_rejects_bad_arguments():
    m = make_map(SIZES)
    with pytest.raises(ValueError, match="window"):
        ShardAwareSampler(FakeDataset(len(m)), shard_map=m, window=0)
    with pytest.raises(ValueError, match="covers"):
        ShardAwareSampler(FakeDataset(len(m) + 1), shard_map=m)
    with pytest.raises(TypeError, match="file paths"):
        ShardAwareSampler(FakeDataset(3))
    with pytest.raises(ValueError, match="divide"):
        DistributedShardSampler(FakeDataset(len(m)), shard_map=m, num_replicas=3, rank=0,
                                local_world_size=2)
    with pytest.raises(RuntimeError, match="num_replicas"):
        DistributedShardSampler(FakeDataset(len(m)), shard_map=m)


def stats(shards: int, files: int, shard_mb: float, cache_mb: float) -> dict:
    return {"shards": shards, "files": files, "dataset_bytes": int(shards * shard_mb * 2**20),
            "cache_budget_bytes": int(cache_mb * 2**20)}


def test_fitting_window_keeps_the_working_set_in_the_cache():
    # ImageNet in 147 shards of ~1 GiB, 50 GiB cache: the full default window.
    assert fitting_window(stats(147, 1_281_167, 1024, 50 * 1024)) == 4
    # Dataset fits the cache: whole shards are always cached, any window works.
    assert fitting_window(stats(24, 6000, 16, 1024)) == 4
    # 24 shards of 250 files, cache = a quarter: ~K * (1 + 512/250) shards must fit in 6.
    assert fitting_window(stats(24, 6000, 16.6, 99.6)) == 1
    # 2000 files a shard: ~1.26 K shards, in 3/4 of the cache (the rest for the spread of
    # concurrent readers): 3.
    assert fitting_window(stats(24, 48000, 16.6, 99.6)) == 3
    # The bench's over-cache scenario: 28 shards of ~36 files, a 7-shard cache. Window 3 (the
    # working set alone) let DataLoader workers' reads push shards out: 2 leaves room.
    assert fitting_window({**stats(28, 1000, 4.06, 27.1), "working_set_reads": 35}) == 2
    assert fitting_window(stats(100, 100_000, 64, 64)) == 1  # never below 1
    assert fitting_window(stats(100, 100_000, 64, 6400), preferred=8) == 8


# -- DistributedShardSampler ------------------------------------------------------------------


def all_ranks(m: ShardMap, replicas: int, epoch: int = 0, **kw) -> list[list[int]]:
    out = []
    for rank in range(replicas):
        s = DistributedShardSampler(FakeDataset(len(m)), shard_map=m, num_replicas=replicas,
                                    rank=rank, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("replicas", "local"), [(2, 1), (3, 1), (4, 2), (5, 5), (6, 3)])
def test_equal_lengths_and_coverage_like_distributed_sampler(replicas, local, drop_last):
    m = make_map(SIZES)  # 204 samples: not divisible by 5 (or by 8 below)
    n = len(m)
    for epoch in (0, 1):
        orders = all_ranks(m, replicas, epoch, drop_last=drop_last, local_world_size=local)
        stock = DistributedSampler(FakeDataset(n), num_replicas=replicas, rank=0,
                                   drop_last=drop_last)
        assert {len(o) for o in orders} == {len(stock)}
        counts = Counter(i for o in orders for i in o)
        total = len(stock) * replicas
        if drop_last:
            assert max(counts.values()) == 1 and len(counts) == total
        else:
            assert set(counts) == set(range(n))
            assert sum(counts.values()) - n == total - n  # only padding repeats


def test_uneven_n_pads_by_repeating():
    m = make_map([3, 4])  # 7 samples over 4 ranks: 2 each, one repeat
    orders = all_ranks(m, 4)
    assert [len(o) for o in orders] == [2, 2, 2, 2]
    counts = Counter(i for o in orders for i in o)
    assert set(counts) == set(range(7)) and sum(counts.values()) == 8
    tiny = make_map([1])  # fewer samples than ranks
    assert [len(o) for o in all_ranks(tiny, 3)] == [1, 1, 1]
    assert [len(o) for o in all_ranks(tiny, 3, drop_last=True)] == [0, 0, 0]


def test_nodes_read_disjoint_shards_redealt_every_epoch():
    sizes = [20] * 16
    m = make_map(sizes)
    dealt = []
    for epoch in range(3):
        orders = all_ranks(m, 4, epoch, local_world_size=2, window=2)
        nodes = [{int(m.shard_of[i]) for o in orders[j:j + 2] for i in o} for j in (0, 2)]
        shared = nodes[0] & nodes[1]
        assert len(shared) <= 1  # only where the node boundary cuts a shard
        assert 7 <= len(nodes[0]) <= 9 and len(nodes[0] | nodes[1]) == 16
        # The ranks of one node read the same shards, at the same time.
        for j in (0, 2):
            a, b = ({int(m.shard_of[i]) for i in o} for o in orders[j:j + 2])
            assert a == b
            assert max_open(orders[j], m) <= 2
        dealt.append(frozenset(nodes[0]))
    assert len(set(dealt)) > 1


def test_each_rank_switches_shard_about_once_per_shard():
    m = make_map(SIZES)
    for epoch in range(3):
        for order in all_ranks(m, 3, epoch, window=1):
            shards = {int(m.shard_of[i]) for i in order}
            assert runs(order, m) <= len(shards) + 1  # +1: a padding repeat


def test_deterministic_across_processes_same_seed_epoch():
    m = make_map(SIZES)
    assert all_ranks(m, 3, 5, seed=9) == all_ranks(m, 3, 5, seed=9)
    assert all_ranks(m, 3, 5, seed=9) != all_ranks(m, 3, 6, seed=9)


def test_local_world_size_from_environment(monkeypatch):
    m = make_map(SIZES)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = DistributedShardSampler(FakeDataset(len(m)), shard_map=m, num_replicas=4, rank=3)
    assert (s.num_nodes, s.node, s.local_rank) == (2, 1, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.warns(UserWarning, match="LOCAL_RANK"):
        DistributedShardSampler(FakeDataset(len(m)), shard_map=m, num_replicas=4, rank=3)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=12),
       nodes=st.integers(1, 3), local=st.integers(1, 3), drop_last=st.booleans(),
       window=st.integers(1, 4), epoch=st.integers(0, 5), unknown=st.integers(0, 5))
def test_distributed_properties(sizes, nodes, local, drop_last, window, epoch, unknown):
    m = make_map(sizes, seed=epoch, unknown=unknown)
    n, replicas = len(m), nodes * local
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        orders = all_ranks(m, replicas, epoch, drop_last=drop_last, local_world_size=local,
                           window=window)
    per = n // replicas if drop_last else -(-n // replicas)
    assert all(len(o) == per for o in orders)
    counts = Counter(i for o in orders for i in o)
    assert sum(counts.values()) == per * replicas
    if drop_last:
        assert max(counts.values(), default=1) == 1
    else:
        assert set(counts) == set(range(n))


# -- learning the map from a real mount ------------------------------------------------------


def test_learns_shards_from_a_mount_and_caches_the_map(dataset, mounter: Mounter,
                                                      tmp_path: Path, monkeypatch):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None, "--no-warm")
    ds = datasets.ImageFolder(str(m.mountpoint / "train"), loader=lambda p: p)
    truth = {name: rec.path.name for rec in dataset.shards.shards
             for name, *_ in rec.members}
    cache = tmp_path / "maps"
    s = ShardAwareSampler(ds, map_cache=cache, window=1)
    strip = len(str(m.mountpoint)) + 1
    for i, (path, _) in enumerate(ds.samples):
        assert Path(s.map.url(i) or "").name == truth[path[strip:]]
    assert len(s.map.shards) == len(dataset.shards.shards)
    assert runs(list(s), s.map) == len(dataset.shards.shards)
    assert mount_stats(ds.samples[0][0])["files"] == len(ds)
    assert mount_stats(tmp_path) is None
    assert ShardAwareSampler(ds, map_cache=cache).window == 4  # the dataset fits the cache
    assert len(list(cache.glob("*.map"))) == 1

    # Second time: loaded from the cache (only a few spot checks reach the mount).
    calls = []
    real = st_mod._shard_url
    monkeypatch.setattr(st_mod, "_shard_url", lambda p: calls.append(p) or real(p))
    again = shard_map(sample_paths(ds), cache=cache)
    assert torch.equal(again.shard_of, s.map.shard_of) and again.shards == s.map.shards
    assert len(calls) <= st_mod._SPOT_CHECKS

    # A stale map (a remount of other shards at the same paths) is detected and rebuilt.
    target = next(cache.glob("*.map"))
    wrong = ShardMap(tuple(reversed(s.map.shards)), s.map.shard_of)
    target.write_bytes(st_mod._encode_map(wrong))
    calls.clear()
    dirs: list[str] = []
    real_dir_map = st_mod._dir_map
    monkeypatch.setattr(st_mod, "_dir_map", lambda d: dirs.append(d) or real_dir_map(d))
    fixed = shard_map(sample_paths(ds), cache=cache)
    assert torch.equal(fixed.shard_of, s.map.shard_of) and fixed.shards == s.map.shards
    # Rebuilt from the mount: one directory-page read per class, not one call per file.
    assert len(dirs) == len(ds.classes)
    assert len(calls) <= st_mod._SPOT_CHECKS
    for damage in (b"garbage", b'{"format": "shardfs-shardmap/1"}\n', target.read_bytes()[:-4]):
        target.write_bytes(damage)
        assert torch.equal(shard_map(sample_paths(ds), cache=cache).shard_of, s.map.shard_of)

    # Subsets map through their indices; the sampler drives a DataLoader as RandomSampler does.
    sub = Subset(ds, list(range(0, len(ds), 3)))
    assert sample_paths(sub) == [ds.samples[i][0] for i in sub.indices]
    loader = DataLoader(ds, batch_size=16, sampler=ShardAwareSampler(ds, map_cache=cache),
                        collate_fn=lambda b: b)
    assert sorted(p for batch in loader for p, _ in batch) == sorted(p for p, _ in ds.samples)

    # A mount whose cache holds only ~2 shards gets a window of 1 by default.
    small = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None, "--no-warm",
                          "--cache-size", "300K")
    ds_small = datasets.ImageFolder(str(small.mountpoint / "train"), loader=lambda p: p)
    assert ShardAwareSampler(ds_small, map_cache=cache).window == 1  # a 2-shard cache
    assert ShardAwareSampler(ds_small, map_cache=cache, window=3).window == 3
