"""read/fetch.py: which bytes of a download are in, and exactly when each waiting read wakes."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from shardfs.read.fetch import Fetch, FetchFailed

CHUNK = 1000


async def _woken_after_each_chunk(fetch: Fetch, ranges: list[tuple[int, int]],
                                  chunks: list[tuple[int, int]]) -> list[set[int]]:
    """Wait on every range, feed the chunks one by one; after each, which waiters are done."""
    done: set[int] = set()
    seen: list[set[int]] = []

    async def wait(i: int, start: int, end: int) -> None:
        await fetch.wait_for(start, end)
        done.add(i)

    async with trio.open_nursery() as nursery:
        for i, (start, end) in enumerate(ranges):
            nursery.start_soon(wait, i, start, end)
        await trio.testing.wait_all_tasks_blocked()
        for start, n in chunks:
            fetch.filled(start, n)
            await trio.testing.wait_all_tasks_blocked()
            seen.append(set(done))
        nursery.cancel_scope.cancel()  # a waiter never woken fails the asserts, not hangs
    return seen


def test_frontier_wakes_each_read_when_its_end_arrives() -> None:
    fetch = Fetch(0, None, 10 * CHUNK)
    ranges = [(0, 2500), (4000, 4001), (9000, 10 * CHUNK), (2500, 3000), (100, 200)]
    chunks = [(at, CHUNK) for at in range(0, 10 * CHUNK, CHUNK)]
    seen = trio.run(_woken_after_each_chunk, fetch, ranges, chunks)
    assert seen[0] == {4}  # [100, 200)
    assert seen[1] == {4}  # 2000 in: (0, 2500) still short of its end
    assert seen[2] == {0, 3, 4}
    assert seen[3] == {0, 3, 4}  # 4000 in: byte 4000 is not
    assert seen[4] == {0, 1, 3, 4}
    assert seen[8] == {0, 1, 3, 4}
    assert seen[9] == {0, 1, 2, 3, 4}
    assert fetch.arrived == 10 * CHUNK and fetch.has(0, 10 * CHUNK)


def test_split_fetch_wakes_reads_of_later_runs() -> None:
    fetch = Fetch(0, None, 10 * CHUNK)
    fetch.split = True  # as Reader._split marks it: bytes now arrive out of order
    ranges = [(6000, 6500), (500, 1500), (5500, 6500), (8000, 9000)]
    chunks = [(6000, CHUNK), (0, CHUNK), (5000, CHUNK), (1000, CHUNK), (8000, CHUNK)]
    seen = trio.run(_woken_after_each_chunk, fetch, ranges, chunks)
    assert seen == [{0}, {0}, {0, 2}, {0, 1, 2}, {0, 1, 2, 3}]
    assert fetch.arrived == 2 * CHUNK  # the contiguous prefix: all the FUSE workers are told
    assert fetch.has(5000, 7000) and not fetch.has(1500, 5500)


def test_failed_fetch_raises_in_every_waiter() -> None:
    fetch = Fetch(0, None, 10 * CHUNK)
    errors: list[BaseException] = []

    async def wait(start: int, end: int) -> None:
        try:
            await fetch.wait_for(start, end)
        except FetchFailed as e:
            errors.append(e)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for start in (0, 3000, 7000):
                nursery.start_soon(wait, start, start + 10)
            await trio.testing.wait_all_tasks_blocked()
            fetch.filled(0, CHUNK)  # serves the first
            fetch.fail(OSError("connection reset"))
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert len(errors) == 2 and all("connection reset" in str(e) for e in errors)
    with pytest.raises(FetchFailed):
        trio.run(fetch.wait_for, 5000, 5010)  # a read after the failure fails at once
