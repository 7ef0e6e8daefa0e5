"""The daemon's Lookahead on its own: real tar shards read through the real file:// source.

Policy details that a mount test cannot pin down cheaply: coalescing of neighbours, pacing on
a full buffer, dropping streams whose announcements do not match their reads, closing.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import trio

from shardfs.read.arena import BLOCK, Arena, ArenaView
from shardfs.read.lookahead import LAUNCH_BATCH, Lookahead, LookaheadPolicy
from shardfs.sources import ShardInfo, Sources

Member = tuple[int, int, int]  # shard, offset, size


def make_shards(tmp_path: Path, shards: int = 3, files: int = 20,
                size: int = 20_000) -> tuple[list[Path], list[Member], dict[Member, bytes]]:
    paths, members, content = [], [], {}
    for k in range(shards):
        path = tmp_path / f"s{k}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(files):
                data = bytes([k, i]) * (size // 2 + i)
                info = tarfile.TarInfo(f"f{i:03d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        with tarfile.open(path) as tar:
            for info in tar.getmembers():
                ref = (k, info.offset_data, info.size)
                members.append(ref)
                content[ref] = tar.extractfile(info).read()  # type: ignore[union-attr]
        paths.append(path)
    return paths, members, content


async def shard_infos(sources: Sources, paths: list[Path]) -> list[ShardInfo]:
    return [await sources.for_url(p.as_uri()).stat(p.as_uri()) for p in paths]


async def take_all(la: Lookahead, refs: list[Member], content: dict[Member, bytes]) -> None:
    for ref in refs:
        shard, off, size = ref
        data = await la.take(shard, off, size, off, off + size)
        assert data == content[ref]


def run(tmp_path: Path, policy: LookaheadPolicy, body) -> Lookahead:
    paths, members, content = make_shards(tmp_path)

    async def main() -> Lookahead:
        sources = Sources()
        try:
            la = Lookahead(await shard_infos(sources, paths), sources, policy)
            async with trio.open_nursery() as nursery:
                await nursery.start(la.run)
                with trio.fail_after(60):
                    await body(la, members, content)
                nursery.cancel_scope.cancel()
            return la
        finally:
            await sources.aclose()

    return trio.run(main)


def test_neighbours_share_a_get_and_bytes_stay_close_to_reads(tmp_path: Path):
    async def body(la, members, content):
        stream = la.open_stream()
        assert stream.announce(members) == (len(members), 0)  # in tar order: all neighbours
        await take_all(la, members, content)

    # max_requests 2: the stream's first 4 entries get a GET each (first bytes soonest).
    la = run(tmp_path, LookaheadPolicy(buffer_bytes=1 << 20, max_requests=2), body)
    s = la.stats
    assert s.hits == 60 and s.misses == 0
    assert s.requests <= 4 + 8, s  # then neighbours coalesced (512-byte headers between them)
    assert s.bytes_fetched <= 1.05 * s.hit_bytes
    assert s.buffered_bytes == 0  # every member read is dropped


def test_full_buffer_paces_fetching(tmp_path: Path):
    buffer = 100_000  # ~4 members of ~20 KB; 60 announced

    async def body(la, members, content):
        order = members[::-1]  # reverse order: nothing to coalesce
        la.open_stream().announce(order)
        await trio.sleep(0.5)
        assert la.stats.buffered_bytes <= buffer
        assert la.stats.requests < 10  # stopped at the buffer, waiting for reads
        await take_all(la, order, content)

    la = run(tmp_path, LookaheadPolicy(buffer_bytes=buffer), body)
    assert la.stats.hits == 60
    assert la.stats.peak_buffered_bytes <= buffer
    assert la.stats.bytes_fetched <= 1.05 * la.stats.hit_bytes


def test_mismatched_stream_is_dropped_and_others_go_on(tmp_path: Path):
    async def body(la, members, content):
        wrong = la.open_stream()
        wrong.announce(members[:20])
        await trio.sleep(0.5)  # fetched up to the buffer, never read
        for _ in range(la.policy.miss_limit + 1):  # reads of files nobody announced
            assert await la.take(2, 10**9, 1, 10**9, 10**9 + 1) is None
        right = la.open_stream()
        right.announce(members[20:40])
        await take_all(la, members[20:40], content)
        assert la.stats.resets == 1  # `wrong` was reset to make room
        assert wrong.live == 0

    la = run(tmp_path, LookaheadPolicy(buffer_bytes=100_000, miss_limit=50), body)
    assert la.stats.stale >= 4 and la.stats.stale_bytes > 0
    assert la.stats.hits == 20


def test_reads_far_past_an_entry_drop_it_and_close_drops_the_rest(tmp_path: Path):
    async def body(la, members, content):
        stream = la.open_stream()
        stream.announce(members)
        # The reader skips member 0 and reads 1..10: with stale_lag 4, 0..5 are left behind.
        await take_all(la, members[1:11], content)
        assert la.stats.stale >= 1
        shard, off, size = members[0]
        assert await la.take(shard, off, size, off, off + 1) is None
        stream.close()
        assert la.stats.connections == 0 and stream.live == 0
        await trio.sleep(0.2)  # GETs in flight land and are dropped
        assert la.stats.buffered_bytes == 0

    run(tmp_path, LookaheadPolicy(buffer_bytes=1 << 20, stale_lag=4), body)


def test_a_read_of_an_entry_not_yet_fetched_fetches_it_now(tmp_path: Path):
    async def body(la, members, content):
        la.open_stream().announce(members)
        last = members[-1]  # far behind the buffer's window
        await take_all(la, [last], content)
        assert la.stats.urgent == 1

    run(tmp_path, LookaheadPolicy(buffer_bytes=50_000), body)


def test_the_first_gets_start_before_the_rest_are_planned(tmp_path: Path):
    """The Lookahead launches LAUNCH_BATCH GETs, then lets them start before it plans the
    next (planning a fill opens its shard's part file: the epoch's first GETs had waited for
    all of those opens)."""
    events: list[str] = []

    async def body(la, members, content):
        launch, fetch = la._launch, la._fetch

        def planned(group):
            events.append("plan")
            launch(group)

        async def started(group):
            events.append("get")
            await fetch(group)

        la._launch, la._fetch = planned, started
        first = members[:24]  # the epoch's first entries: one GET each
        la.open_stream().announce(first)
        with trio.fail_after(10):
            while la.stats.requests < len(first):
                await trio.sleep(0.005)
        await take_all(la, first, content)

    run(tmp_path, LookaheadPolicy(buffer_bytes=64 << 20, max_requests=32), body)
    assert events.count("plan") == events.count("get") == 24, events
    assert events.index("get") == LAUNCH_BATCH, events


def test_shared_arena_serves_members_and_publishes_where_they_are(tmp_path: Path):
    """As FUSE workers use it: members land in the arena, a second mapping (as a worker maps
    it) copies them out, `taken` counts those reads, and what is freed is published as gone."""

    async def body(la, members, content):
        where = la.share()
        assert where is not None
        view = ArenaView(*where)
        stream = la.open_stream()
        stream.announce(members)
        ahead: dict[tuple[int, int], tuple[int, int]] = {}
        for ref in members[:30]:
            shard, off, size = ref
            with trio.fail_after(30):
                while (shard, off) not in ahead:  # what the daemon tells the workers
                    await la.published.wait()
                    la.published = trio.Event()
                    for s, o, at, gen in la.landed:
                        ahead[s, o] = (at, gen)
                    la.landed = []
            at, gen = ahead[shard, off]
            assert view.copy(at, gen, 0, size) == content[ref]
            la.taken(shard, off, at, size)  # served in full: freed and published as gone
            assert (shard, off, at, gen) in la.gone
            assert view.copy(at, gen, 0, size) is None  # a stale location is never read
        # The rest is read by the daemon itself, from the arena too.
        await take_all(la, members[30:], content)
        stream.close()  # the last stream gone, the arena empty: its memory is given back
        assert os.fstat(la.arena.fd).st_blocks * 512 <= la.arena.total - la.arena.size + BLOCK

    la = run(tmp_path, LookaheadPolicy(buffer_bytes=200_000), body)
    assert la.stats.shared_hits == 30 and la.stats.hits == 60 and la.stats.unshared == 0
    assert la.stats.buffered_bytes == 0
    assert la.arena is not None and la.arena.used == 0


def test_arena_allocates_frees_and_joins_runs():
    arena = Arena(10 * BLOCK)
    try:
        view = ArenaView(arena.path, arena.total, arena.size)
        a, b, c = arena.alloc(3 * BLOCK), arena.alloc(1), arena.alloc(5 * BLOCK)
        assert (a, b, c) == (0, 3 * BLOCK, 4 * BLOCK)
        assert arena.alloc(2 * BLOCK) is None  # 1 block left
        arena.view[b : b + 5] = b"hello"
        gen = arena.gen(b)
        assert view.copy(b, gen, 1, 4) == b"ell"
        arena.free(b, 1)
        assert view.copy(b, gen, 1, 4) is None
        arena.free(a, 3 * BLOCK)  # joins the freed block after it: 4 blocks from 0
        assert arena.alloc(4 * BLOCK) == 0
        arena.free(0, 4 * BLOCK)
        arena.free(c, 5 * BLOCK)  # joins both sides: one run again
        assert arena.alloc(10 * BLOCK) == 0 and arena.used == 10 * BLOCK
        arena.view[: arena.size] = b"x" * arena.size
        held = os.fstat(arena.fd).st_blocks
        arena.free(0, 10 * BLOCK)
        arena.trim()  # the memory goes back; generations stay
        assert os.fstat(arena.fd).st_blocks < held
        assert bytes(arena.view[:3]) == bytes(3) and arena.gen(0) == 3  # freed three times
    finally:
        arena.close()


def test_skipped_entries_are_not_kept(tmp_path: Path):
    """An epoch whose shards the reader serves by itself (here: all of them, as when the
    dataset is cached) skips every entry; the stream keeps no slot for them."""
    paths, members, _ = make_shards(tmp_path)

    async def main() -> None:
        sources = Sources()
        try:
            la = Lookahead(await shard_infos(sources, paths), sources, LookaheadPolicy(),
                           covered=lambda shard: True)
            async with trio.open_nursery() as nursery:
                await nursery.start(la.run)
                stream = la.open_stream()
                stream.announce(members)
                with trio.fail_after(10):
                    while la.stats.skipped < len(members):
                        await trio.sleep(0.01)
                assert len(stream.order) == 0 and stream.live == 0
                assert la.stats.requests == 0
                nursery.cancel_scope.cancel()
        finally:
            await sources.aclose()

    trio.run(main)
