"""The shard cache on a real disk: layout, lock, crash leftovers, budget, LRU, pins."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from shardfs.cache.shardcache import (
    CacheError,
    ShardCache,
    ShardFileChanged,
    open_shard_file,
    pwrite_all,
    shard_key,
)


@pytest.fixture
def opened() -> Iterator[list[ShardCache]]:
    """Caches opened by a test; closed afterwards, checked to be within budget."""
    caches: list[ShardCache] = []
    yield caches
    for cache in caches:
        assert cache.used <= cache.budget
        cache.close()


def open_cache(root: Path, budget: int, opened: list[ShardCache]) -> ShardCache:
    cache = ShardCache(root, budget)
    cache.open()
    opened.append(cache)
    return cache


def put(cache: ShardCache, key: str, data: bytes) -> None:
    """Fetch a shard the way the reader does: reserve, write the part file, commit."""
    assert cache.reserve(key, len(data))
    part = cache.begin(key, len(data))
    os.pwrite(part.fd, data, 0)
    trio.run(cache.commit, part)


def read_back(cache: ShardCache, key: str) -> bytes:
    shard = cache.get(key)
    assert shard is not None and shard.fd is not None
    return os.pread(shard.fd, shard.size + 1, 0)


def test_open_creates_layout_and_lock(tmp_path: Path, opened: list[ShardCache]) -> None:
    root = tmp_path / "deep" / "cache"
    cache = open_cache(root, 1000, opened)
    for sub in ("shards", "index", "trees"):
        assert (root / sub).is_dir()
    assert (root / "lock").read_text() == str(os.getpid())
    assert cache.used == 0 and cache.complete_count == 0
    assert cache.index_path("k") == root / "index" / "k.idx"
    assert cache.tree_path("k") == root / "trees" / "k.tree"


def test_second_cache_on_same_dir_is_refused(tmp_path: Path, opened: list[ShardCache]) -> None:
    first = open_cache(tmp_path / "c", 1000, opened)
    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CacheError, match=rf"in use .*pid {os.getpid()}\b"):
            ShardCache(tmp_path / "c", 1000).open()
    # A refused open leaves no file descriptor behind.
    assert len(os.listdir("/proc/self/fd")) == fds_before
    first.close()
    second = open_cache(tmp_path / "c", 1000, opened)  # the lock is free again
    assert (tmp_path / "c" / "lock").read_text() == str(os.getpid())
    second.close()


def test_stale_lock_file_from_dead_daemon_is_taken(tmp_path: Path,
                                                   opened: list[ShardCache]) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (root / "lock").write_text("999999999")  # written by a daemon that is gone: no flock
    open_cache(root, 1000, opened)
    assert (root / "lock").read_text() == str(os.getpid())


def test_part_leftovers_deleted_complete_files_adopted(tmp_path: Path,
                                                       opened: list[ShardCache]) -> None:
    root = tmp_path / "c"
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "aaa").write_bytes(b"x" * 100)
    (root / "shards" / "bbb").write_bytes(b"y" * 50)
    (root / "shards" / "ccc.part").write_bytes(b"z" * 70)  # a fetch killed mid-way
    (root / "shards" / "ddd.tmp123").write_bytes(b"w" * 10)
    cache = open_cache(root, 1000, opened)
    assert sorted(os.listdir(root / "shards")) == ["aaa", "bbb"]
    assert cache.has("aaa") and cache.has("bbb")
    assert not cache.has("ccc") and not cache.has("ccc.part") and not cache.has("ddd.tmp123")
    assert cache.used == 150 and cache.complete_count == 2
    assert read_back(cache, "aaa") == b"x" * 100


def test_half_written_index_and_tree_files_are_dropped(tmp_path: Path,
                                                       opened: list[ShardCache]) -> None:
    """Left by a crash or a full disk (a partial tree can be large): never reused, deleted."""
    root = tmp_path / "c"
    for sub, names in (("index", ["k.idx", "k.idx.tmp4242", "j.idx.tmp1"]),
                       ("trees", ["t.tree", "t.tree.tmp77", "tmpab12cd.list"])):
        (root / sub).mkdir(parents=True)
        for name in names:
            (root / sub / name).write_bytes(b"x")
    open_cache(root, 1000, opened)
    assert os.listdir(root / "index") == ["k.idx"]
    assert os.listdir(root / "trees") == ["t.tree"]


def test_adopted_shards_keep_lru_order_and_budget_shrink(tmp_path: Path,
                                                         opened: list[ShardCache]) -> None:
    root = tmp_path / "c"
    (root / "shards").mkdir(parents=True)
    for n, key in enumerate(["new", "old", "mid"]):
        path = root / "shards" / key
        path.write_bytes(bytes([n]) * 100)
    # Last access times: old < mid < new.
    for key, atime in [("old", 1_000_000), ("mid", 2_000_000), ("new", 3_000_000)]:
        os.utime(root / "shards" / key, ns=(atime * 10**9, atime * 10**9))
    cache = open_cache(root, 250, opened)  # the budget shrank: one must go, the oldest
    assert sorted(os.listdir(root / "shards")) == ["mid", "new"]
    assert not cache.has("old") and cache.has("mid") and cache.has("new")
    assert cache.used == 200 and cache.evictions == 1 and cache.evicted_bytes == 100


def test_reserve_begin_commit(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 10_000, opened)
    key = shard_key("file:///x.tar\x001000\x00etag\x00")
    data = os.urandom(1000)
    assert not cache.has(key) and cache.get(key) is None
    assert cache.reserve(key, len(data))
    assert cache.used == 1000  # a reservation counts
    assert not cache.reserve(key, len(data))  # reserved twice: no
    part = cache.begin(key, len(data))
    assert part.path == tmp_path / "c" / "shards" / f"{key}.part"
    assert os.path.getsize(part.path) == 1000  # sparse, full size from the start
    assert not cache.has(key)  # a part file is never taken for a shard
    os.pwrite(part.fd, data[:400], 0)
    os.pwrite(part.fd, data[400:], 400)
    assert os.pread(part.fd, 100, 0) == data[:100]
    shard = trio.run(cache.commit, part)
    assert shard.key == key and shard.size == 1000
    assert cache.has(key) and cache.complete_count == 1
    assert cache.used == 1000
    assert not part.path.exists()
    assert (tmp_path / "c" / "shards" / key).read_bytes() == data
    assert read_back(cache, key) == data
    assert not cache.reserve(key, len(data))  # already complete


def test_reserve_larger_than_budget_fails(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 1000, opened)
    put(cache, "small", b"s" * 600)
    assert not cache.reserve("big", 1001)
    assert cache.has("small")  # nothing evicted for a reservation that cannot succeed
    assert cache.used == 600
    assert cache.reserve("exact", 1000)  # fits once "small" is evicted
    assert not cache.has("small") and cache.used == 1000


def test_lru_eviction_order(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 300, opened)
    put(cache, "a", b"a" * 100)
    put(cache, "b", b"b" * 100)
    put(cache, "c", b"c" * 100)
    assert cache.get("a") is not None  # a is now the most recently used; b the least
    put(cache, "d", b"d" * 100)
    assert [k for k in "abcd" if cache.has(k)] == ["a", "c", "d"]
    assert not (tmp_path / "c" / "shards" / "b").exists()
    assert cache.get("b") is None
    assert cache.evictions == 1 and cache.evicted_bytes == 100
    # Making room for 200 bytes takes the two least recently used: c, then a.
    cache.get("d")
    put(cache, "e", b"e" * 200)
    assert [k for k in "abcde" if cache.has(k)] == ["d", "e"]
    assert cache.used == 300
    assert read_back(cache, "d") == b"d" * 100 and read_back(cache, "e") == b"e" * 200


def test_pinned_shards_are_never_evicted(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 300, opened)
    put(cache, "a", b"a" * 100)
    put(cache, "b", b"b" * 100)
    put(cache, "c", b"c" * 100)
    cache.pin("a")
    cache.pin("a")
    put(cache, "d", b"d" * 100)  # a is the oldest but pinned: b goes
    assert [k for k in "abcd" if cache.has(k)] == ["a", "c", "d"]
    cache.pin("c")
    cache.pin("d")
    # Nothing unpinned is left: no room, and nothing is evicted in trying.
    assert not cache.reserve("e", 100)
    assert not cache.evict_to_fit(1)
    assert [k for k in "acd" if cache.has(k)] == ["a", "c", "d"]
    cache.unpin("d")
    cache.unpin("c")
    # 200 bytes need two shards evicted; a still holds one pin of two, so c and d go.
    cache.unpin("a")
    assert cache.reserve("e", 200)
    assert cache.has("a") and not cache.has("c") and not cache.has("d")
    cache.abort(None, "e")
    cache.unpin("a")  # no pins left: a may go now
    assert cache.reserve("f", 300)
    assert cache.complete_count == 0
    cache.abort(None, "f")
    with pytest.raises(KeyError):
        cache.unpin("a")  # more unpins than pins is a caller bug


def test_partial_eviction_does_not_happen_when_it_cannot_help(
    tmp_path: Path, opened: list[ShardCache]
) -> None:
    cache = open_cache(tmp_path / "c", 300, opened)
    put(cache, "a", b"a" * 100)
    put(cache, "b", b"b" * 150)
    cache.pin("b")
    # Room for 250 needs b gone; evicting a alone would not make it: a must survive.
    assert not cache.reserve("x", 250)
    assert cache.has("a") and cache.has("b") and cache.evictions == 0
    cache.unpin("b")


def test_abort_drops_part_and_reservation(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 1000, opened)
    assert cache.reserve("k", 800)
    part = cache.begin("k", 800)
    os.pwrite(part.fd, b"partial", 0)
    assert cache.used == 800
    cache.abort(part, "k")
    assert cache.used == 0
    assert not part.path.exists() and os.listdir(tmp_path / "c" / "shards") == []
    with pytest.raises(OSError):
        os.fstat(part.fd)  # closed
    assert not cache.has("k")
    assert cache.reserve("k", 800)  # may be fetched again
    cache.abort(None, "k")  # a fetch that failed before its part file existed
    assert cache.used == 0


def test_reserve_without_eviction(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 300, opened)
    put(cache, "a", b"a" * 200)
    assert not cache.reserve("b", 200, evict=False)
    assert cache.has("a")
    assert cache.reserve("b", 100, evict=False)
    assert cache.used == 300
    cache.abort(None, "b")


def test_used_accounting(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 10_000, opened)
    assert cache.used == 0
    put(cache, "a", b"1" * 1000)
    assert cache.used == 1000
    assert cache.reserve("b", 2000)
    assert cache.reserve("c", 3000)
    assert cache.used == 6000
    part = cache.begin("b", 2000)
    trio.run(cache.commit, part)
    assert cache.used == 6000 and cache.complete_count == 2
    cache.abort(None, "c")
    assert cache.used == 3000
    assert cache.reserve("d", 7000)
    assert cache.used == 10_000
    assert not cache.reserve("e", 1, evict=False)
    cache.abort(None, "d")


def test_shard_removed_behind_our_back(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 1000, opened)
    put(cache, "a", b"a" * 10)
    cache.close()  # drops the open fds, keeps the bookkeeping
    os.unlink(tmp_path / "c" / "shards" / "a")
    assert cache.get("a") is None
    assert not cache.has("a") and cache.used == 0


def test_reopen_keeps_complete_shards(tmp_path: Path, opened: list[ShardCache]) -> None:
    cache = open_cache(tmp_path / "c", 1000, opened)
    put(cache, "a", b"a" * 10)
    assert cache.reserve("b", 20)
    part = cache.begin("b", 20)  # "crash" with b half fetched
    os.pwrite(part.fd, b"b" * 5, 0)
    os.close(part.fd)
    cache.close()
    again = open_cache(tmp_path / "c", 1000, opened)
    assert again.has("a") and not again.has("b")
    assert again.used == 10
    assert os.listdir(tmp_path / "c" / "shards") == ["a"]


def test_unusable_cache_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CacheError, match="not usable"):
        ShardCache(blocker / "cache", 1000).open()
    with pytest.raises(CacheError, match="not usable"):
        ShardCache(blocker, 1000).open()


def test_shard_key() -> None:
    a = shard_key("https://x/a.tar\x00100\x00etag\x00")
    assert len(a) == 40 and all(c in "0123456789abcdef" for c in a)
    assert a == shard_key("https://x/a.tar\x00100\x00etag\x00")
    assert a != shard_key("https://x/a.tar\x00101\x00etag\x00")
    assert len(shard_key("file:///\udcff.tar")) == 40  # undecodable file names are fine


# -- a full disk (issue #7) ------------------------------------------------------------------


def test_pwrite_all_completes_short_writes(tmp_path: Path, monkeypatch) -> None:
    """A nearly full disk writes part of a pwrite and says so only in its return value;
    ignoring that once left holes of zeros in 'complete' shards."""
    real = os.pwrite
    calls = []

    def short(fd: int, data, offset: int) -> int:
        calls.append(offset)
        return real(fd, bytes(data[:3]), offset)

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        monkeypatch.setattr("shardfs.cache.shardcache.os.pwrite", short)
        pwrite_all(fd, b"0123456789", 5)
        assert calls == [5, 8, 11, 14]
        monkeypatch.setattr("shardfs.cache.shardcache.os.pwrite", lambda fd, data, offset: 0)
        with pytest.raises(OSError) as info:
            pwrite_all(fd, b"x", 0)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == bytes(5) + b"0123456789"


def test_disk_full_lowers_the_budget_and_evicts(tmp_path: Path, opened: list[ShardCache],
                                                monkeypatch) -> None:
    cache = open_cache(tmp_path / "c", 10_000_000, opened)
    for key in "abc":
        put(cache, key, key.encode() * 4096)
    cache.pin("a")
    held = sum(e.stat().st_blocks * 512 for e in os.scandir(cache.shards_dir))

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr("shardfs.cache.shardcache.os.statvfs", lambda path: Full())
    assert cache.disk_full() == held  # what the disk holds: the shards there, no more
    assert cache.budget == held and cache.used <= cache.budget
    assert cache.disk_full() == held  # idempotent
    # Room for a new shard comes from the LRU unpinned one; evict_lru() skips pinned ones.
    assert cache.reserve("d", 4096) and not cache.has("b") and cache.has("a")
    cache.abort(None, "d")
    assert cache.evict_lru() and not cache.has("c")
    assert not cache.evict_lru() and cache.has("a")
    cache.unpin("a")


def test_budget_lowered_under_fetches_in_progress_is_met_as_they_complete(
        tmp_path: Path, opened: list[ShardCache]) -> None:
    """A full disk cuts the budget while fetches hold reservations: the cache is over budget
    until they complete, then older shards make way (CI once ended a soak at 389 KB used of a
    229 KB budget: evict_to_fit evicts nothing when eviction alone cannot make room)."""
    cache = open_cache(tmp_path / "c", 40_000, opened)
    for key in "ab":
        put(cache, key, key.encode() * 8192)
    cache.pin("a")  # a reader waits on it
    assert cache.reserve("c", 8192) and cache.reserve("d", 8192)
    parts = [cache.begin(key, 8192) for key in "cd"]
    cache.budget = 20_000  # what disk_full() does, with a disk that holds 20 KB
    cache.trim()
    assert cache.has("a") and not cache.has("b")  # what could go; "a" is pinned
    assert cache.used > cache.budget  # the reservations: nothing else to evict yet
    cache.unpin("a")
    for part in parts:
        os.pwrite(part.fd, b"x" * 8192, 0)
        trio.run(cache.commit, part)
    assert not cache.has("a") and cache.has("d")
    assert cache.used <= cache.budget


def test_a_linked_shard_holds_no_budget_and_is_never_evicted(
        tmp_path: Path, opened: list[ShardCache]) -> None:
    """A shard read in place (read/inplace.py): `shards/KEY` a link to its own file."""
    own = tmp_path / "own.tar"
    own.write_bytes(b"x" * 800)
    cache = open_cache(tmp_path / "c", 1000, opened)
    cache.link("linked", str(own), 800, own.stat().st_mtime_ns)
    assert os.readlink(tmp_path / "c" / "shards" / "linked") == str(own)
    assert cache.has("linked") and cache.used == 0
    assert read_back(cache, "linked") == b"x" * 800
    put(cache, "a", b"a" * 600)
    put(cache, "b", b"b" * 600)  # evicts a, never the link
    assert not cache.has("a") and cache.has("linked") and cache.used == 600
    assert cache.evict_lru() and not cache.has("b")
    assert not cache.evict_lru()  # the link is all that is left: nothing frees room
    assert cache.has("linked") and cache.evictions == 2
    assert os.path.islink(tmp_path / "c" / "shards" / "linked")


def test_a_link_opens_only_while_its_file_is_the_one_linked(
        tmp_path: Path, opened: list[ShardCache]) -> None:
    """A shard file replaced after it was linked (a new version renamed over it) is not
    opened through the link: its reads would go to other bytes at the old index's offsets.
    Copied shards open as before."""
    own = tmp_path / "own.tar"
    own.write_bytes(b"x" * 800)
    cache = open_cache(tmp_path / "c", 1000, opened)
    cache.link("linked", str(own), 800, own.stat().st_mtime_ns)
    link = tmp_path / "c" / "shards" / "linked"
    assert os.lstat(link).st_mtime_ns == own.stat().st_mtime_ns
    os.close(open_shard_file(link, 800))
    new = tmp_path / "new.tar"
    new.write_bytes(b"z" * 800)  # same size, other bytes, its own mtime
    os.utime(new, ns=(1, own.stat().st_mtime_ns + 1))
    os.replace(new, own)
    with pytest.raises(ShardFileChanged, match="changed since it was linked"):
        open_shard_file(link, 800)
    assert cache.get("linked") is None and not cache.has("linked")  # forgotten: fetched
    os.utime(own, ns=(1, os.lstat(link).st_mtime_ns))  # the mtime again, another size
    with pytest.raises(ShardFileChanged):
        open_shard_file(link, 799)
    put(cache, "a", b"a" * 100)
    os.close(open_shard_file(tmp_path / "c" / "shards" / "a", 100))  # a copy: no check


def test_links_are_not_adopted_and_replace_a_kept_part(tmp_path: Path,
                                                       opened: list[ShardCache]) -> None:
    """A mount links its shards again each time (after checking them); a part an earlier
    daemon left of a shard now read in place is dropped with its record."""
    own = tmp_path / "own.tar"
    own.write_bytes(b"y" * 100)
    cache = open_cache(tmp_path / "c", 1000, opened)
    cache.link("linked", str(own), 100, own.stat().st_mtime_ns)
    assert cache.reserve("k", 100)
    part = cache.begin("k", 100)
    assert part.record is not None
    os.pwrite(part.fd, b"y" * 100, 0)
    part.record.extend([0])  # claims a block: kept by the next start
    os.close(part.fd)
    part.record.close()
    cache.close()
    again = open_cache(tmp_path / "c", 1000, opened)
    assert not again.has("linked") and "k" in again.kept and again.used == 100
    assert sorted(os.listdir(tmp_path / "c" / "shards")) == ["k.part", "linked"]
    again.link("k", str(own), 100, own.stat().st_mtime_ns)
    assert again.kept == {} and again.used == 0 and again.has("k")
    assert again.drop_old_links() == 1  # "linked" was not linked again by this mount
    assert os.listdir(tmp_path / "c" / "shards") == ["k"]
    assert not again.record_path("k").exists()
    assert own.read_bytes() == b"y" * 100  # the shard's own file untouched


def test_a_remount_keeps_the_links_of_unchanged_files_and_makes_the_others_again(
        tmp_path: Path, opened: list[ShardCache]) -> None:
    """Links cost metadata writes (a symlink and its mtime each): a mount that links the
    same file with the same mtime keeps the earlier mount's link as it is; a file whose
    mtime changed gets a new link with the new mtime; links not made again are dropped."""
    files = []
    for name in ("a", "b", "c"):
        own = tmp_path / f"{name}.tar"
        own.write_bytes(name.encode() * 100)
        files.append(own)
    cache = open_cache(tmp_path / "c", 1000, opened)
    for own in files:
        cache.link(own.stem, str(own), 100, own.stat().st_mtime_ns)
    shards = tmp_path / "c" / "shards"
    before = {own.stem: os.lstat(shards / own.stem).st_ctime_ns for own in files}
    cache.close()
    os.utime(files[1], ns=(1, files[1].stat().st_mtime_ns + 1))  # b: another mtime
    again = open_cache(tmp_path / "c", 1000, opened)
    assert not any(again.has(own.stem) for own in files)  # nothing taken before linking
    for own in files[:2]:  # c is not linked by this mount
        again.link(own.stem, str(own), 100, own.stat().st_mtime_ns)
    assert os.lstat(shards / "a").st_ctime_ns == before["a"]  # kept: nothing written
    assert os.lstat(shards / "b").st_mtime_ns == files[1].stat().st_mtime_ns  # made again
    assert again.drop_old_links() == 1
    assert sorted(os.listdir(shards)) == ["a", "b"]
    for own in files[:2]:
        assert read_back(again, own.stem) == own.read_bytes()
