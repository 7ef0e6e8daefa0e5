"""The addresses h1's connections are opened to (shardfs/sources/addresses.py): an IP literal
with no pause of the loop, a name resolved once for a burst of connections and again after
its time, over real connections to nginx."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from shardfs.devtools.nginx import Nginx
from shardfs.sources import HttpSource, ShardInfo
from shardfs.sources.addresses import Addresses
from tests.test_h1 import pool
from tests.test_sources import put, read, with_http


@pytest.mark.parametrize(("host", "family", "address"), [
    ("127.0.0.1", socket.AF_INET, ("127.0.0.1", 8080)),
    ("::1", socket.AF_INET6, ("::1", 8080, 0, 0))])
def test_an_ip_literal_is_its_own_address_with_no_pause_of_the_loop(
        host: str, family: socket.AddressFamily, address: tuple) -> None:
    """No lookup and no checkpoint: a GET launched before the loop plans the next ones
    connects in its first step (trio's getaddrinfo checkpoints even for a literal)."""
    addresses = Addresses()

    async def main() -> None:
        with trio.testing.assert_no_checkpoints():
            (info,) = await addresses.get(host, 8080)
        assert info[0] == family and info[1] == socket.SOCK_STREAM and info[4] == address
        assert addresses.lookups == 0

    trio.run(main)


def test_a_name_is_resolved_once_for_its_time_then_again() -> None:
    """localhost (from /etc/hosts: no network needed) is asked of the resolver once for
    any number of connections within TTL_S, and again once that time has passed."""
    addresses = Addresses(ttl_s=3600)
    expected = {(i[0], i[4]) for i in socket.getaddrinfo("localhost", 80,
                                                         type=socket.SOCK_STREAM)}

    async def main() -> None:
        for _ in range(5):
            infos = await addresses.get("localhost", 80)
            assert {(i[0], i[4]) for i in infos} == expected
        assert addresses.lookups == 1
        addresses.ttl_s = 0  # its time has passed
        await addresses.get("localhost", 80)
        assert addresses.lookups == 2
        addresses.ttl_s = 3600
        addresses.forget("localhost", 80)  # none of them answered: asked again
        await addresses.get("localhost", 80)
        assert addresses.lookups == 3

    trio.run(main)


def test_connections_to_a_named_origin_share_one_lookup(nginx: Nginx) -> None:
    """Sixteen GETs at once, as the first of a fresh source, over fresh connections to
    http://localhost:PORT: every byte right, the name asked of the resolver once (the
    others waited for that lookup), sixteen connections opened."""
    data = put(nginx.root, "named.tar")

    async def check(source: HttpSource) -> None:
        shard = ShardInfo(url=f"http://localhost:{nginx.port}/named.tar", size=len(data))
        h1 = pool(source)
        spans = [(i * 50_000, i * 50_000 + 40_000) for i in range(16)]
        got: dict[int, bytes] = {}

        async def one(i: int) -> None:
            got[i] = await read(source, shard, *spans[i])

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        assert all(got[i] == data[a:b] for i, (a, b) in enumerate(spans))
        assert h1.addresses.lookups == 1, h1.addresses.lookups
        assert h1.opened >= 16, h1.opened

    with_http(check)
