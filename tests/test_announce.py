"""The announce socket's handling on its own: paths resolved against a real catalog's tree, and
a long announcement handled in slices with the loop's other tasks running between them."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Awaitable
from pathlib import Path

import trio

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import Catalog, open_catalog
from shardfs.daemon import announce
from shardfs.daemon.announce import _handle, resolver
from shardfs.read.lookahead import Lookahead, LookaheadPolicy
from shardfs.sources import Sources


def catalog_of(tmp_path: Path, names: list[str], sources: Sources) -> Awaitable[Catalog]:
    """A real catalog of one tar shard holding files of these names."""
    path = tmp_path / "s0.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, name in enumerate(names):
            data = bytes([i % 251]) * (1000 + i)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    cache.open()
    return open_catalog([path.as_uri()], sources, cache)


def test_paths_resolve_as_the_tree_resolves_them(tmp_path: Path):
    names = ["top.bin", "a/x.bin", "a/y.bin", "a/b/z.bin", "c/d/e/w.bin"]

    async def main() -> None:
        sources = Sources()
        try:
            catalog = await catalog_of(tmp_path, names, sources)
        finally:
            await sources.aclose()
        tree = catalog.tree
        resolve = resolver(tree)
        for name in names:
            ino = tree.resolve(name.encode())
            ref = tree.file_ref(ino)
            want = (ref.shard, ref.offset, tree.stored_size(ino))
            # each twice: the second time its directory comes from the resolver's memory
            for spelling in (name, "/" + name, name.replace("/", "//"), name, "./" + name,
                             name + "/."):
                assert resolve(spelling) == want, spelling
        for bad in ("a", "a/b", "", "/", "a/nothere.bin", "nodir/x.bin", "a/../top.bin",
                    "top.bin/x", "c/d", 7):
            assert resolve(bad) is None, bad  # type: ignore[arg-type]

    trio.run(main)


def test_a_long_announcement_is_handled_in_slices(tmp_path: Path):
    """Each slice of SLICE paths is announced before the next is resolved, with a checkpoint
    between: a task of the loop sees the window grow, instead of waiting for all of it."""
    names = [f"d{i % 7}/f{i:05d}.bin" for i in range(3 * announce.SLICE + 10)]

    async def main() -> None:
        sources = Sources()
        try:
            catalog = await catalog_of(tmp_path, names, sources)
            la = Lookahead(catalog.shards, sources, LookaheadPolicy(max_pending=len(names)))
            stream = la.open_stream("test")
            seen: list[int] = []
            done = trio.Event()

            async def watch() -> None:
                while not done.is_set():
                    seen.append(stream.live)
                    await trio.lowlevel.checkpoint()

            line = json.dumps({"reset": True, "paths": [*names, "nothere.bin"]}).encode()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.lowlevel.checkpoint()  # the watcher runs first
                reply = await _handle(line, stream, resolver(catalog.tree), lambda s: 0)
                done.set()
            assert reply == {"accepted": len(names), "refused": 0, "unknown": 1,
                             "pending": len(names)}
            assert [e.start for e in stream.order] == sorted(e.start for e in stream.order)
            # (trio runs ready tasks in no fixed order: the watcher may miss a slice, not all)
            between = sorted({n for n in seen if 0 < n < len(names)})
            assert between, seen
            assert all(n % announce.SLICE == 0 for n in between), between
        finally:
            await sources.aclose()

    trio.run(main)
