"""Shard-aware samplers tell the daemon which shards they read next (announce socket,
`{"shards": [...]}`), and the daemon fetches them whole in that order within its cache budget.

Real mounts over nginx with published indexes (--no-warm): every GET nginx logs is one the
reads or the announcements caused.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardfs.torch.announce import AnnounceLink
from tests.conftest import Dataset, Mount, Mounter, brace
from tests.faultproxy import FaultProxy
from tests.test_ddp import publish_with_index

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")

from shardfs.torch import DistributedShardSampler, ShardAwareSampler  # noqa: E402


def mount(ds: Dataset, nginx, mounter: Mounter, *extra: str) -> Mount:
    publish_with_index(ds, nginx.root)
    m = mounter.mount([brace(ds, f"{nginx.url}/data")], None, None, "--no-warm", *extra)
    assert m.stats()["bytes_fetched"] == 0
    nginx.reset_log()
    return m


def folder(m: Mount) -> datasets.ImageFolder:
    return datasets.ImageFolder(str(m.mountpoint / "train"), loader=lambda p: p)


def shard_order(sampler, order: list[int]) -> list[str]:
    """Shard file names in the order the sampler's `order` first meets them."""
    seen: dict[str, None] = {}
    for index in order:
        url = sampler.map.url(index)
        if url is not None:
            seen.setdefault(Path(url).name)
    return list(seen)


def whole_gets(nginx, ds: Dataset) -> list[str]:
    """The shards nginx sent whole, in the order it finished sending them."""
    sizes = {s.path.name: s.size for s in ds.shards.shards}
    return [Path(r.uri).name for r in nginx.access_log()
            if sizes.get(Path(r.uri).name) == r.bytes_sent]


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_next_shards_are_fetched_whole_in_the_samplers_order(dataset, nginx,
                                                                  mounter: Mounter):
    # One fetch slot: GETs go one after another, so nginx's log shows the order they started.
    m = mount(dataset, nginx, mounter, "--max-fetches", "1")
    ds = folder(m)
    sampler = ShardAwareSampler(ds, window=1, seed=5)
    shards = len(dataset.shards.shards)
    it = iter(sampler)
    first = next(it)  # the iterator has announced; nothing has been read
    wait_for(lambda: m.stats()["shards_cached"] == shards, "announced shards never arrived")
    order = [first, *it]
    assert whole_gets(nginx, dataset) == shard_order(sampler, order)
    stats = m.stats()
    assert stats["reader"]["reads"] == 0 and stats["reader"]["member_fetches"] == 0
    assert stats["reader"]["ahead_fetches"] == shards
    # Then the epoch is read from the cache: no more requests.
    nginx.reset_log()
    for i in order:
        assert Path(ds.samples[i][0]).read_bytes() == (dataset.root / Path(
            ds.samples[i][0]).relative_to(m.mountpoint)).read_bytes()
    assert nginx.access_log() == []


def test_no_shards_ahead_when_the_dataset_is_larger_than_the_cache(dataset, nginx,
                                                                  mounter: Mounter):
    # Shards held for later would push shards being read out of a cache that cannot hold
    # them all: the daemon ignores the announcements and the sampler does not send them.
    sizes = [s.size for s in dataset.shards.shards]
    budget = sum(sizes[:3]) + min(sizes) // 2
    m = mount(dataset, nginx, mounter, "--cache-size", str(budget))
    link = AnnounceLink(m.stats()["lookahead_socket"])
    try:
        link.post({"shards": [s.members[0][0] for s in dataset.shards.shards]})
        assert link.collect() == [{"queued": 0, "unknown": 0}]
    finally:
        link.close()
    time.sleep(0.3)
    assert m.stats()["shards_fetching"] == 0 and whole_gets(nginx, dataset) == []
    ds = folder(m)
    sampler = ShardAwareSampler(ds, window=1, seed=2)
    assert sampler._ahead.lead == 0
    for i in sampler:
        rel = Path(ds.samples[i][0]).relative_to(m.mountpoint)
        assert Path(ds.samples[i][0]).read_bytes() == (dataset.root / rel).read_bytes()
    stats = m.stats()
    assert stats["cache_used_bytes"] <= budget and stats["reader"]["eio"] == 0
    assert stats["reader"]["ahead_fetches"] == 0


def test_distributed_ranks_of_a_node_announce_their_shards(dataset, nginx, mounter: Mounter):
    m = mount(dataset, nginx, mounter, "--max-fetches", "1")
    ds = folder(m)
    ranks = [DistributedShardSampler(ds, num_replicas=2, rank=r, local_world_size=2, window=1)
             for r in range(2)]
    iters = [iter(s) for s in ranks]
    firsts = [next(i) for i in iters]
    shards = len(dataset.shards.shards)
    wait_for(lambda: m.stats()["shards_cached"] == shards, "announced shards never arrived")
    gets = whole_gets(nginx, dataset)
    assert sorted(gets) == sorted(set(gets))  # both ranks named the same shards: one GET each
    assert firsts


def test_a_bad_announcement_is_answered_and_the_connection_goes_on(dataset, nginx,
                                                                   mounter: Mounter):
    m = mount(dataset, nginx, mounter)
    link = AnnounceLink(m.stats()["lookahead_socket"])
    try:
        name = dataset.shards.shards[0].members[0][0]
        link.post({"shards": ["no/such/file.jpg", "../../etc/passwd", name]})
        (reply,) = link.collect()
        assert reply == {"queued": 1, "unknown": 2}
        link.post({"shards": "train"})
        with pytest.raises(ConnectionError, match="shards must be a list"):
            link.collect()
        link.post({"shards": [name]})  # cached or being fetched: not queued again
        assert link.collect() == [{"queued": 0, "unknown": 0}]
    finally:
        link.close()
    wait_for(lambda: m.stats()["shards_cached"] == 1, "the announced shard never arrived")
    assert whole_gets(nginx, dataset) == [dataset.shards.shards[0].path.name]


def test_a_closed_connection_drops_its_shards_not_started(dataset, nginx, mounter: Mounter):
    """Announced shards still waiting when the announcing connection closes are not fetched."""
    publish_with_index(dataset, nginx.root)
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([brace(dataset, f"{proxy.url}/data")], None, None, "--no-warm",
                          "--max-fetches", "1", "--timeout", "30")
        proxy.stall(2.0, after_bytes=1024, times=1)  # the first shard's GET takes 2 s
        link = AnnounceLink(m.stats()["lookahead_socket"])
        try:
            link.post({"shards": [s.members[0][0] for s in dataset.shards.shards]})
            assert link.collect() == [{"queued": len(dataset.shards.shards), "unknown": 0}]
        finally:
            link.close()  # while the first fetch stalls and the others wait
        wait_for(lambda: m.stats()["shards_cached"] >= 1, "the started shard never arrived")
        time.sleep(0.5)
        stats = m.stats()
        assert stats["shards_cached"] == 1 and stats["shards_fetching"] == 0, stats
        assert stats["reader"]["ahead_fetches"] == 1


def test_the_sample_paths_are_built_once_per_sampler(dataset, nginx, mounter: Mounter,
                                                     monkeypatch):
    """The shard map, the mount's stats and the announcements all need the dataset's paths;
    for ImageNet each build of the list costs ~0.2 s before the first batch."""
    import shardfs.torch.samplers as shardfs_samplers

    m = mount(dataset, nginx, mounter)
    ds = folder(m)
    builds = []
    real = shardfs_samplers.sample_paths

    def counted(d):
        builds.append(d)
        return real(d)

    monkeypatch.setattr(shardfs_samplers, "sample_paths", counted)
    sampler = ShardAwareSampler(ds, window=1, seed=3, map_cache=False)
    order = list(sampler)
    assert sorted(order) == list(range(len(ds)))
    assert m.stats()["reader"]["ahead_fetches"] > 0  # the announcements did use the paths
    assert len(builds) == 1
