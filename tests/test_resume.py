"""Resuming an epoch mid-way: `state_dict()` / `load_state_dict()` of Lookahead and the shard
samplers, through torchdata's StatefulDataLoader (with DataLoader worker processes), on real
mounts over nginx, and in real DDP ranks (tests/ddp_resume.py).

What must hold: the indices read before the checkpoint plus those read after the resume are
the uninterrupted epoch's order, each index once, and the resumed mount is told the order from
the resume point on (not the part already read).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Mounter, brace
from tests.test_ddp import _env, publish_with_index

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from torch.utils.data import (  # noqa: E402
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from shardfs.torch import (  # noqa: E402
    DistributedShardSampler,
    Lookahead,
    ShardAwareSampler,
    ShardMap,
)
from tests.test_lookahead import folder, gen, mount_small  # noqa: E402

StatefulDataLoader = stateful.StatefulDataLoader
SCRIPT = Path(__file__).resolve().parent / "ddp_resume.py"


class Indexed(torch.utils.data.Dataset):
    """A dataset whose sample i is i (reading the file when `read`): batches say which indices
    the loader consumed."""

    def __init__(self, ds, read: bool = True) -> None:
        self.ds, self.read = ds, read
        self.samples = getattr(ds, "samples", None)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> int:
        if self.read:
            with open(self.ds.samples[i][0], "rb") as f:
                f.read()
        return i


def halves(make_sampler, data, stop: int, *, workers: int, batch: int = 4,
           epoch: int | None = None) -> tuple[list[int], list[int], dict]:
    """Read `stop` batches, checkpoint, then resume in a fresh sampler and loader (as a
    restarted job does) and read the rest: (indices before, indices after, the state)."""
    kw = dict(batch_size=batch, num_workers=workers)
    first_sampler = make_sampler()
    if epoch is not None:
        first_sampler.set_epoch(epoch)
    loader = StatefulDataLoader(data, sampler=first_sampler, **kw)
    before: list[int] = []
    for k, b in enumerate(loader):
        before += b.tolist()
        if k + 1 == stop:
            break
    state = loader.state_dict()
    del loader
    sampler = make_sampler()
    if epoch is not None:
        sampler.set_epoch(epoch)
    loader = StatefulDataLoader(data, sampler=sampler, **kw)
    loader.load_state_dict(state)
    after = [i for b in loader for i in b.tolist()]
    return before, after, state


def check_union(before: list[int], after: list[int], expected: list[int]) -> None:
    assert before + after == expected
    assert before and after


# -- without a mount: the order logic alone ---------------------------------------------------


NOT_ON_A_MOUNT = "ignore:the dataset's files are not on a shardfs mount"


@pytest.mark.filterwarnings(NOT_ON_A_MOUNT)
@pytest.mark.parametrize("workers", [0, 2])
def test_lookahead_random_sampler_halves_are_the_stock_epoch(workers: int):
    data = Indexed(list(range(97)), read=False)
    paths = [f"/nowhere/{i}" for i in range(97)]

    def make():
        return Lookahead(RandomSampler(data, generator=gen(4)), paths=paths)

    expected = list(RandomSampler(data, generator=gen(4)))
    before, after, _ = halves(make, data, 5, workers=workers)
    check_union(before, after, expected)


@pytest.mark.filterwarnings(NOT_ON_A_MOUNT)
def test_lookahead_global_rng_and_distributed_epoch():
    data = Indexed(list(range(50)), read=False)
    paths = [f"/nowhere/{i}" for i in range(50)]
    # RandomSampler without a generator: its order's seed comes from torch's global RNG.
    torch.manual_seed(11)
    stock = list(RandomSampler(data))
    torch.manual_seed(11)
    s = Lookahead(RandomSampler(data), paths=paths)
    it = iter(s)
    before = [next(it) for _ in range(20)]
    state = s.state_dict()
    torch.manual_seed(999)  # the restarted job's RNG is elsewhere
    other = torch.get_rng_state()
    resumed = Lookahead(RandomSampler(data), paths=paths)
    resumed.load_state_dict(state)
    assert before + list(resumed) == stock
    assert torch.equal(torch.get_rng_state(), other)  # the caller's RNG is left as it was

    # DistributedSampler: the order is its seed and epoch; the state carries the epoch.
    stock_d = DistributedSampler(data, num_replicas=3, rank=1, seed=5)
    stock_d.set_epoch(7)
    s = Lookahead(DistributedSampler(data, num_replicas=3, rank=1, seed=5), paths=paths)
    s.set_epoch(7)
    it = iter(s)
    before = [next(it) for _ in range(6)]
    state = s.state_dict()
    assert state["epoch"] == 7 and state["yielded"] == 6
    fresh = Lookahead(DistributedSampler(data, num_replicas=3, rank=1, seed=5), paths=paths)
    fresh.load_state_dict(state)  # sets the wrapped sampler's epoch too
    assert before + list(fresh) == list(stock_d)
    # The resume is used once; the next iteration is a whole epoch again.
    assert list(fresh) == list(stock_d)
    # A set_epoch to another epoch drops a loaded position: that epoch starts from its start.
    fresh.load_state_dict(state)
    fresh.set_epoch(8)
    stock_d.set_epoch(8)
    assert list(fresh) == list(stock_d)
    # Bad states are refused with a clear error.
    with pytest.raises(ValueError, match="this one has 10"):
        Lookahead(SubsetRandomSampler(list(range(10))), data, paths=paths).load_state_dict(state)
    # Not on a mount, a Lookahead still resumes (it passes the order through); other samplers
    # drawing from their generator resume exactly too.
    seq = Lookahead(SequentialSampler(data), paths=paths)
    assert not seq.active
    for make in (lambda: SubsetRandomSampler(list(range(0, 50, 2)), generator=gen(2)),
                 lambda: WeightedRandomSampler([1.0] * 50, 80, generator=gen(3)),
                 lambda: SequentialSampler(data)):
        s = Lookahead(make(), data, paths=paths)
        it = iter(s)
        before = [next(it) for _ in range(9)]
        again = Lookahead(make(), data, paths=paths)
        again.load_state_dict(s.state_dict())
        assert before + list(again) == list(make())
    with pytest.raises(ValueError, match="not a shardfs sampler state"):
        fresh.load_state_dict({"yielded": 3})
    with pytest.raises(ValueError, match="of a ShardAwareSampler"):
        fresh.load_state_dict({**state, "sampler": "ShardAwareSampler"})


def fake_map(n: int, shards: int) -> ShardMap:
    return ShardMap.from_urls([f"http://x/s{i % shards:03d}.tar" for i in range(n)])


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_samplers_halves_are_the_fresh_epoch(workers: int):
    n = 203
    data = Indexed(list(range(n)), read=False)
    m = fake_map(n, 9)

    def make():
        return ShardAwareSampler(data, seed=3, window=2, shard_map=m, map_cache=False)

    # Without set_epoch every iteration is the next epoch: the resumed one is the saved one.
    plain = make()
    expected = list(plain)
    before, after, state = halves(make, data, 7, workers=workers, batch=5)
    check_union(before, after, expected)
    assert state  # a StatefulDataLoader state
    # With set_epoch, and the distributed sampler's ranks: each rank's halves are its order.
    for rank in range(3):
        def make_d(rank=rank):
            return DistributedShardSampler(data, num_replicas=3, rank=rank, seed=1, window=2,
                                           shard_map=m, map_cache=False)

        ref = make_d()
        ref.set_epoch(4)
        before, after, _ = halves(make_d, data, 3, workers=workers, batch=5, epoch=4)
        check_union(before, after, list(ref))


def test_shard_sampler_state_checks():
    n = 60
    data = list(range(n))
    m = fake_map(n, 4)
    s = ShardAwareSampler(data, seed=3, window=2, shard_map=m, map_cache=False)
    s.set_epoch(2)
    it = iter(s)
    before = [next(it) for _ in range(17)]
    state = s.state_dict()
    assert (state["epoch"], state["yielded"], state["window"]) == (2, 17, 2)
    # The window a mount picks may differ after a restart: the saved one is used.
    other = ShardAwareSampler(data, seed=3, window=3, shard_map=m, map_cache=False)
    other.load_state_dict(state)
    assert other.window == 2
    ref = ShardAwareSampler(data, seed=3, window=2, shard_map=m, map_cache=False)
    ref.set_epoch(2)
    assert before + list(other) == list(ref)
    with pytest.raises(ValueError, match="seed"):
        ShardAwareSampler(data, seed=4, shard_map=m, map_cache=False).load_state_dict(state)
    with pytest.raises(ValueError, match="map"):
        ShardAwareSampler(data, seed=3, shard_map=fake_map(n, 5),
                          map_cache=False).load_state_dict(state)
    with pytest.raises(ValueError, match="DistributedShardSampler"):
        DistributedShardSampler(data, num_replicas=1, rank=0, seed=3, shard_map=m,
                                map_cache=False).load_state_dict(state)
    d = DistributedShardSampler(data, num_replicas=2, rank=0, seed=3, shard_map=m,
                                map_cache=False)
    with pytest.raises(ValueError, match="rank"):
        DistributedShardSampler(data, num_replicas=2, rank=1, seed=3, shard_map=m,
                                map_cache=False).load_state_dict(d.state_dict())
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({**state, "yielded": n + 1})


# -- on a mount: the daemon is told the order from the resume point -----------------------------


def settled(m) -> dict:
    """The mount's stats once the daemon has read every announcement of the closed
    connections (it handles what is left in a socket before it sees the close)."""
    deadline = time.monotonic() + 30
    while m.stats()["lookahead"]["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return m.stats()


def test_lookahead_resume_on_a_mount_prefetches_from_the_resume_point(dataset, nginx,
                                                                      mounter: Mounter):
    m = mount_small(dataset, nginx, mounter)
    ds = folder(m)
    data = Indexed(ds)

    def make():
        return Lookahead(RandomSampler(ds, generator=gen(21)))

    expected = list(RandomSampler(ds, generator=gen(21)))
    stop, batch = 5, 4
    first_sampler = make()
    loader = StatefulDataLoader(data, sampler=first_sampler, batch_size=batch, num_workers=2)
    before: list[int] = []
    for k, b in enumerate(loader):
        before += b.tolist()
        if k + 1 == stop:
            break
    state = loader.state_dict()
    del loader
    first_sampler.close()  # the job "stops": the daemon drops what it announced
    mid = settled(m)
    sampler = make()
    loader = StatefulDataLoader(data, sampler=sampler, batch_size=batch, num_workers=2)
    loader.load_state_dict(state)
    after = [i for b in loader for i in b.tolist()]
    check_union(before, after, expected)
    assert len(before) == stop * batch
    end = m.stats()
    la0, la1 = mid["lookahead"], end["lookahead"]
    # Exactly the rest was announced (the part read before the checkpoint was not) ...
    assert la1["announced"] - la0["announced"] == len(after)
    # ... and read from what the daemon fetched ahead.
    reads = end["reader"]["reads"] - mid["reader"]["reads"]
    hits = la1["hits"] - la0["hits"]
    assert hits >= 0.8 * reads, (hits, reads, la1)
    assert end["reader"]["eio"] == 0


def run_ranks(mounts, tmp_path: Path, phase: str, state_dir: Path) -> dict[str, list[dict]]:
    out = tmp_path / f"out-{phase}"
    cmd = [sys.executable, str(SCRIPT), *(str(mt.mountpoint / "train") for mt in mounts),
           "--samplers", ",".join(DDP_SAMPLERS), "--phase", phase, "--state", str(state_dir),
           "--out", str(out), "--stop-after", "3", "--epoch", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=250,
                            env={**_env(), "SHARDFS_SAMPLER_CACHE": str(tmp_path / "maps"),
                                 "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stdout + result.stderr
    return {kind: [json.loads((out / f"{kind}-rank{r}.json").read_text()) for r in range(2)]
            for kind in DDP_SAMPLERS}


DDP_SAMPLERS = ("lookahead", "shard")


@pytest.mark.timeout(600)
def test_ddp_ranks_resume(dataset, nginx, mounter: Mounter, tmp_path: Path):
    """Two DDP ranks (gloo, one mount each, as two nodes) stop after 3 batches of epoch 1 and
    save their StatefulDataLoader state; a new job (new processes) resumes: per rank, the
    halves are that rank's uninterrupted order, and together the ranks read every index.
    Lookahead(DistributedSampler), then DistributedShardSampler, in each job."""
    publish_with_index(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")
    mounts = [mounter.mount([source], None, None, "--no-warm", "--cache-size", "256KiB")
              for _ in range(2)]
    state_dir = tmp_path / "state"
    first = run_ranks(mounts, tmp_path, "first", state_dir)
    mid = [settled(mt) for mt in mounts]
    rest = run_ranks(mounts, tmp_path, "rest", state_dir)
    n = dataset.shards.nfiles
    for kind in DDP_SAMPLERS:
        union = []
        for r in range(2):
            assert len(first[kind][r]["indices"]) == 3 * first[kind][r]["batch_size"]
            assert first[kind][r]["indices"] + rest[kind][r]["indices"] == \
                rest[kind][r]["expected"], kind
            union += rest[kind][r]["expected"]
        assert sorted(union) == list(range(n)), kind  # 2 ranks, no padding: each index once
    for r, mt in enumerate(mounts):
        # Lookahead announced only the rest of its rank's epoch in the second job.
        la = mt.stats()["lookahead"]
        assert la["announced"] - mid[r]["lookahead"]["announced"] == \
            len(rest["lookahead"][r]["indices"])
        assert mt.stats()["reader"]["eio"] == 0
