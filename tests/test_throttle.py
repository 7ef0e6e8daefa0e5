"""Throttling: full-jitter backoff, the per-mount request budget, and their counters.

The budget's arithmetic runs on trio's virtual clock (MockClock); the sources run against
real loopback servers that throttle: a stand-in answering 429 / 503 SlowDown, and SeaweedFS
behind a gate that answers S3's 503 SlowDown to every other request.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from contextlib import aclosing
from pathlib import Path

import pytest
import trio
import trio.testing

from shardfs.daemon.metrics import _Collector
from shardfs.sources import HttpSource, ShardInfo, Sources, SourceSettings, SourceStats
from shardfs.sources.budget import MIN_RATE, RequestBudget
from shardfs.sources.http import _Patience, _Retry
from shardfs.sources.sigv4 import Credentials
from tests.cloud_standins import Answer, Request, serve

FAST = SourceSettings(timeout=5.0, deadline=20.0, backoff_initial=0.05, backoff_max=0.5,
                      chunk_size=32 * 1024)
BODY = random.Random(7).randbytes(200_003)


def test_configured_budget_paces_requests() -> None:
    async def main() -> None:
        budget = RequestBudget(rate=10.0, burst=5)
        start = trio.current_time()
        for _ in range(25):
            await budget.acquire()
        elapsed = trio.current_time() - start
        assert 1.95 <= elapsed <= 2.05  # 5 at once, then 20 at 10/s
        assert budget.waits == 20 and budget.wait_s == pytest.approx(elapsed, abs=0.01)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_unconfigured_budget_adapts_to_throttling() -> None:
    async def main() -> None:
        budget = RequestBudget(rate=None, burst=4)
        for _ in range(100):  # 100 requests within one second: no limit yet
            await budget.acquire()
            await trio.sleep(0.01)
        assert budget.rate is None and budget.waits == 0
        budget.throttled()  # observed ~100/s: cut to about half of it
        assert budget.rate is not None and 45 <= budget.rate <= 55
        cut = budget.rate
        budget.throttled()  # an answer to a request sent before the cut: no second cut
        assert budget.rate == cut
        await trio.sleep(1.0)
        budget.throttled()
        assert budget.rate == pytest.approx(max(MIN_RATE, cut / 2), rel=0.3)
        start = trio.current_time()
        for _ in range(40):
            await budget.acquire()
            budget.succeeded()  # the rate grows back while requests go through
        assert trio.current_time() - start > 1.0  # the cut rate was enforced
        assert budget.rate > cut / 2
        await trio.sleep(10.0)
        budget.succeeded()  # doubled every 2 s: well past the rate that was cut
        assert budget.rate is None  # limit lifted

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_retries_are_jittered_not_synchronised() -> None:
    """Twenty clients failing at the same instant retry at twenty different times."""

    async def main() -> None:
        settings = SourceSettings(backoff_initial=1.0, backoff_max=8.0, deadline=100.0)
        woke: list[float] = []

        async def client(i: int) -> None:
            patience = _Patience(f"u{i}", settings, SourceStats(), {})
            for _ in range(3):  # third retry: uniform over [0, 4) s
                await patience.wait(_Retry("HTTP 503 SlowDown"))
            woke.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(client, i)
        assert len({round(t, 6) for t in woke}) == 20
        assert max(woke) - min(woke) > 1.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def throttling(every: int, status: int, body: bytes = b"", until: int = 15
               ) -> tuple[object, list[int]]:
    """A range server answering `status` to every `every`-th of its first `until` requests
    (a burst of throttling, as when many clients start at once)."""
    count = [0]
    lock = threading.Lock()
    statuses: list[int] = []

    def route(req: Request) -> Answer:
        with lock:
            count[0] += 1
            n = count[0]
        if n % every == 0 and n <= until:
            statuses.append(status)
            return status, {"Content-Type": "application/xml"}, body
        spec = req.headers.get("range", "bytes=0-")
        first, _, last = spec.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last or len(BODY) - 1), len(BODY) - 1)
        statuses.append(206)
        return 206, {"ETag": '"e"', "Content-Range": f"bytes {start}-{end}/{len(BODY)}"}, \
            BODY[start:end + 1]

    return route, statuses


async def read(source: HttpSource, shard: ShardInfo, start: int, end: int) -> bytes:
    parts = []
    async with aclosing(source.stream(shard, start, end)) as chunks:
        async for chunk in chunks:
            parts.append(chunk)
    return b"".join(parts)


@pytest.mark.parametrize("status", [429, 503])
def test_http_throttling_is_counted_and_cuts_the_budget(status: int) -> None:
    route, statuses = throttling(3, status)
    with serve(route) as server:

        async def main() -> None:
            sources = Sources(FAST)
            try:
                source = sources.for_url(server.url + "/a.tar")
                shard = await source.stat(server.url + "/a.tar")
                for _ in range(20):
                    start = random.randrange(0, len(BODY) - 1000)
                    assert await read(source, shard, start, start + 1000) == \
                        BODY[start:start + 1000]
                stats = sources.stats()
                assert stats.throttled == statuses.count(status) >= 5
                assert stats.retries >= stats.throttled
                assert sources.budget.rate is not None  # adapted below the observed rate
            finally:
                await sources.aclose()

        trio.run(main)


def test_s3_slowdown_from_a_real_server(tmp_path: Path) -> None:
    """SeaweedFS behind a gate answering S3's 503 SlowDown to every other one of the first
    requests: reads
    stay exact, and the throttling shows in the stats and the Prometheus metrics."""
    from shardfs.sources.s3 import S3Config, S3Source
    from tests.cloud_standins import Vendor, gate_route
    from tests.seaweed_fixture import SeaweedServer

    key, secret = "SWTHROTTLE000000", "throttle-secret"
    with SeaweedServer(tmp_path / "weed", {"r": (key, secret, ["Read", "List"])}) as weed:
        weed.admin.create_bucket(Bucket="thr")
        weed.admin.put_object(Bucket="thr", Key="x.tar", Body=BODY)
        forward = gate_route(Vendor([]), weed.url, [])
        n = [0]
        slowdown = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    b"<Message>Please reduce your request rate.</Message></Error>")

        def gate(req: Request) -> Answer:
            n[0] += 1
            if n[0] % 2 == 0 and n[0] <= 14:
                return 503, {"Content-Type": "application/xml"}, slowdown
            return forward(req)

        with serve(gate) as proxy:
            config = S3Config(endpoint=proxy.url, addressing="path",
                              credentials=Credentials(key, secret, None, "test"))
            settings = dataclasses.replace(FAST, request_rate=200.0)

            async def main() -> dict:
                source = S3Source(settings, config=config)
                try:
                    shard = await source.stat("s3://thr/x.tar")
                    for _ in range(12):
                        start = random.randrange(0, len(BODY) - 5000)
                        assert await read(source, shard, start, start + 5000) == \
                            BODY[start:start + 5000]
                    assert source.budget.rate is not None and source.budget.rate < 200.0
                    return dataclasses.asdict(source.stats)
                finally:
                    await source.aclose()

            stats = trio.run(main)
    assert stats["throttled"] >= 6 and stats["by_status"][503] == stats["throttled"]
    metrics = {m.name: m.samples[0].value
               for m in _Collector(lambda: {"source": stats}).collect()}
    assert metrics["shardfs_source_throttled"] == stats["throttled"]
    assert "shardfs_source_credential_refreshes" in metrics


def test_request_rate_option() -> None:
    from shardfs.cli.config import ConfigError, validate

    assert validate({"request_rate": "250"}, "test") == {"request_rate": 250.0}
    with pytest.raises(ConfigError, match="request_rate: bad value 0"):
        validate({"request_rate": 0}, "test")
