"""The namespace: build_tree from shard indexes, queries, merge rules, and persistence."""

from __future__ import annotations

import random
import stat
import time
from pathlib import Path

import pytest

from shardfs.catalog.shardindex import KIND_DIR, KIND_FILE, KIND_LINK, ShardIndex
from shardfs.catalog.tar import Member
from shardfs.catalog.tree import ROOT, TREE_FORMAT, Tree, build_tree


def index_of(*members: Member, size: int = 1 << 30) -> ShardIndex:
    index = ShardIndex(size=size)
    index.extend(members)
    return index


def f(path: bytes, offset: int, size: int = 10, mtime: int = 1000, mode: int = 0o644) -> Member:
    return Member(path, "f", offset, size, mtime, mode)


def d(path: bytes, mtime: int = 2000, mode: int = 0o700) -> Member:
    return Member(path, "d", 0, 0, mtime, mode)


def link(path: bytes, target: bytes) -> Member:
    return Member(path, "l", 0, 0, 3000, 0o777, target)


def all_paths(tree: Tree) -> dict[bytes, int]:
    """Every entry's path, found by walking list_dir from the root."""
    out = {}
    stack = [ROOT]
    while stack:
        ino = stack.pop()
        for child in tree.list_dir(ino):
            out[tree.path(child)] = child
            if tree.is_dir(child):
                stack.append(child)
    return out


def test_basic_queries() -> None:
    tree = build_tree([index_of(
        f(b"train/cat/1.jpg", 512, 11, mtime=111, mode=0o755),
        f(b"train/cat/2.jpg", 1536, 22),
        f(b"train/dog/1.jpg", 2560, 33),
        f(b"README", 4096, 44),
    )])
    assert tree.valid(ROOT) and tree.is_dir(ROOT) and tree.path(ROOT) == b""
    assert not tree.valid(0) and not tree.valid(len(tree) + 1)
    # root, README, train, cat, 2 files, dog, 1 file
    assert len(tree) == 8
    assert tree.count_files() == 4

    train = tree.lookup(ROOT, b"train")
    assert train is not None and tree.is_dir(train)
    cat = tree.lookup(train, b"cat")
    assert cat is not None
    one = tree.lookup(cat, b"1.jpg")
    assert one is not None and not tree.is_dir(one)
    assert tree.name(one) == b"1.jpg"
    assert tree.path(one) == b"train/cat/1.jpg"
    assert tree.resolve(b"train/cat/1.jpg") == one
    assert tree.resolve(b"/train//cat/1.jpg/") == one  # empty components are ignored
    assert tree.resolve(b"") == ROOT
    assert tree.resolve(b"train/cat/3.jpg") is None
    assert tree.resolve(b"train/cat/1.jpg/x") is None  # a file has no children
    assert tree.lookup(cat, b"1.jp") is None
    assert tree.lookup(one, b"anything") is None
    assert tree.list_dir(one) == []

    ref = tree.file_ref(one)
    assert (ref.shard, ref.offset, ref.size) == (0, 512, 11)
    assert tree.st_size(one) == 11
    assert tree.mtime[one - 1] == 111
    # Read-only: no write bits, exec bits kept, always readable.
    assert tree.st_mode(one) == stat.S_IFREG | 0o555
    assert tree.st_mode(tree.resolve(b"train/cat/2.jpg")) == stat.S_IFREG | 0o444
    assert tree.st_mode(cat) == stat.S_IFDIR | 0o555
    assert tree.st_size(cat) == 0

    assert [tree.name(i) for i in tree.list_dir(ROOT)] == [b"README", b"train"]
    assert [tree.name(i) for i in tree.list_dir(cat)] == [b"1.jpg", b"2.jpg"]
    assert [tree.name(i) for i in tree.list_dir(cat, 1)] == [b"2.jpg"]
    assert tree.list_dir(cat, 2) == []
    assert tree.parent[cat - 1] + 1 == train

    for path, ino in all_paths(tree).items():
        assert tree.resolve(path) == ino


def test_implied_parent_directories() -> None:
    tree = build_tree([index_of(f(b"a/b/c/d/e.txt", 512, 5, mtime=77))])
    assert len(tree) == 6
    for depth, path in enumerate([b"a", b"a/b", b"a/b/c", b"a/b/c/d"]):
        ino = tree.resolve(path)
        assert ino is not None and tree.is_dir(ino), path
        assert tree.kind[ino - 1] == KIND_DIR
        assert len(tree.list_dir(ino)) == 1
        assert tree.path(ino) == path
        assert tree.path(ino).count(b"/") == depth
        assert tree.mtime[ino - 1] == 77  # implied dirs take the member's mtime
    leaf = tree.resolve(b"a/b/c/d/e.txt")
    assert leaf is not None and tree.kind[leaf - 1] == KIND_FILE


def test_children_sorted_by_bytes() -> None:
    names = [b"b", b"a.b", b"a", b"B", b"a-b", b"\xff", b"a0", b"\x01", b"10", b"9", b"Z_"]
    rng = random.Random(3)
    members = [f(b"dir/" + n, 512 * (i + 1)) for i, n in enumerate(names)]
    # Children and grand-children of the same prefix must not confuse the order.
    members += [f(b"dir/a/x", 100_000), f(b"dir/a.b.c", 100_512)]
    rng.shuffle(members)
    tree = build_tree([index_of(*members)])
    dir_ino = tree.resolve(b"dir")
    listed = [tree.name(i) for i in tree.list_dir(dir_ino)]
    assert listed == sorted([*names, b"a.b.c"])
    assert tree.is_dir(tree.resolve(b"dir/a"))  # a file "a" and "a/x": conflict -> dir
    for name in listed:
        assert tree.lookup(dir_ino, name) == tree.resolve(b"dir/" + name)


def test_later_shard_wins_duplicates() -> None:
    first = index_of(f(b"x/same.jpg", 512, 1), f(b"x/only0.jpg", 1024, 2),
                     f(b"x/three.jpg", 2048, 3))
    second = index_of(f(b"x/same.jpg", 4096, 4), f(b"x/three.jpg", 8192, 5))
    third = index_of(f(b"x/three.jpg", 16384, 6, mtime=9))
    tree = build_tree([first, second, third])
    assert tree.report.members == 6
    assert tree.report.shadowed == 3  # same.jpg once, three.jpg twice
    same = tree.file_ref(tree.resolve(b"x/same.jpg"))
    assert (same.shard, same.offset, same.size) == (1, 4096, 4)
    three = tree.file_ref(tree.resolve(b"x/three.jpg"))
    assert (three.shard, three.offset, three.size) == (2, 16384, 6)
    assert tree.mtime[tree.resolve(b"x/three.jpg") - 1] == 9
    only0 = tree.file_ref(tree.resolve(b"x/only0.jpg"))
    assert (only0.shard, only0.offset) == (0, 1024)
    # One entry per path.
    assert [tree.name(i) for i in tree.list_dir(tree.resolve(b"x"))] == [
        b"only0.jpg", b"same.jpg", b"three.jpg"]
    # Within one shard too, the later member wins (tar semantics).
    tree = build_tree([index_of(f(b"dup", 512, 1), f(b"dup", 2048, 2))])
    assert tree.file_ref(tree.resolve(b"dup")).offset == 2048
    assert tree.report.shadowed == 1


def test_file_that_is_also_a_directory_prefix() -> None:
    # Shard 0 has a file "a/b"; shard 1 puts members under "a/b/". "a/b" must be a directory.
    tree = build_tree([
        index_of(f(b"a/b", 512, 7), f(b"a/c", 1024, 8)),
        index_of(f(b"a/b/inner.txt", 512, 9)),
    ])
    b = tree.resolve(b"a/b")
    assert b is not None and tree.is_dir(b)
    assert tree.report.conflicts == 1
    assert [tree.name(i) for i in tree.list_dir(b)] == [b"inner.txt"]
    inner = tree.file_ref(tree.resolve(b"a/b/inner.txt"))
    assert (inner.shard, inner.offset, inner.size) == (1, 512, 9)
    assert not tree.is_dir(tree.resolve(b"a/c"))
    # The same with the order of the shards swapped, and a symlink as the prefix.
    tree = build_tree([index_of(f(b"a/b/inner.txt", 512, 9)),
                       index_of(link(b"a/b", b"c"), f(b"a/c", 1024, 8))])
    assert tree.is_dir(tree.resolve(b"a/b"))
    assert tree.report.conflicts == 1
    assert not tree.links


def test_explicit_directory_members() -> None:
    tree = build_tree([index_of(d(b"empty", mtime=5), d(b"full", mtime=6),
                                f(b"full/x", 512), d(b"full/sub", mtime=8))])
    empty = tree.resolve(b"empty")
    assert empty is not None and tree.is_dir(empty) and tree.list_dir(empty) == []
    assert tree.mtime[empty - 1] == 5
    full = tree.resolve(b"full")
    assert tree.mtime[full - 1] == 6
    # An explicit directory is one entry, also when it comes after its children in the tar.
    assert [tree.name(i) for i in tree.list_dir(full)] == [b"sub", b"x"]
    assert len(tree) == 5
    assert tree.st_mode(full) == stat.S_IFDIR | 0o555
    assert tree.report.conflicts == 0
    tree = build_tree([index_of(f(b"late/x", 512), d(b"late", mtime=42))])
    late = tree.resolve(b"late")
    assert len(tree) == 3 and tree.is_dir(late) and tree.mtime[late - 1] == 42


def test_symlinks_kept_and_dangling_counted() -> None:
    tree = build_tree([index_of(
        f(b"data/real.txt", 512, 4),
        link(b"data/ok", b"real.txt"),
        link(b"top", b"data/real.txt"),
        link(b"data/to-dir", b"../data"),
        link(b"data/to-root", b".."),
        link(b"data/dangling", b"missing.txt"),
        link(b"data/deeper/dangling2", b"../nope/x"),
    )])
    ok = tree.resolve(b"data/ok")
    assert ok is not None and tree.kind[ok - 1] == KIND_LINK
    assert tree.links[ok - 1] == b"real.txt"
    assert tree.st_mode(ok) == stat.S_IFLNK | 0o777
    assert tree.st_size(ok) == len(b"real.txt")
    assert tree.links[tree.resolve(b"top") - 1] == b"data/real.txt"
    assert len(tree.links) == 6
    assert all(tree.kind[e] == KIND_LINK for e in tree.links)
    assert tree.report.dangling_links == 2  # to-root points at the root, which exists


def test_save_load_round_trip(tmp_path: Path) -> None:
    tree = build_tree([
        index_of(f(b"a/b/c.txt", 512, 5, mtime=-3), d(b"emptydir"), link(b"a/l", b"b/c.txt"),
                 link(b"a/dangling", b"nope"), f(b"dup", 1024, 1)),
        index_of(f(b"dup", 2048, 2, mtime=2**33), f(b"\xff\xfe/\x01name", 4096, 3, mode=0o751),
                 f(b"a/b/c.txt/x", 8192, 6)),
    ])
    path = tmp_path / "t.tree"
    tree.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["t.tree"]  # no temp file left behind
    back = Tree.load(path)
    assert back.names == tree.names
    assert back.kind == tree.kind
    for name in Tree._ARRAYS:
        got, want = getattr(back, name), getattr(tree, name)
        assert got.typecode == want.typecode and got == want, name
    assert back.links == tree.links
    assert back.report == tree.report
    assert (back.report.shadowed, back.report.conflicts, back.report.dangling_links) == (1, 1, 1)
    for p, ino in all_paths(tree).items():
        assert back.resolve(p) == ino
    # Saving over an existing file replaces it.
    other = build_tree([index_of(f(b"z", 512))])
    other.save(path)
    assert Tree.load(path).names == b"z"


def test_load_damaged_files(tmp_path: Path) -> None:
    tree = build_tree([index_of(*(f(b"d%d/f%d" % (i % 7, i), 512 * (i + 1)) for i in range(300)))])
    path = tmp_path / "t.tree"
    tree.save(path)
    data = path.read_bytes()
    header_end = data.index(b"\n") + 1
    damaged = {
        "cut-in-arrays": data[: len(data) - 100],
        "cut-by-one": data[:-1],
        "cut-in-names": data[: header_end + 10],
        "header-only": data[:header_end],
        "cut-in-header": data[: header_end // 2],
        "trailing": data + b"\0",
        "empty": b"",
        "garbage": bytes(range(256)) * 20,
        "json-number": b"5\n" + data[header_end:],
        "json-null": b"null\n" + data[header_end:],
        "json-list": b"[]\n" + data[header_end:],
        "other-format": data.replace(TREE_FORMAT.encode(), b"shardfs-tree/0", 1),
        "missing-keys": b'{"format": "%s"}\n' % TREE_FORMAT.encode() + data[header_end:],
    }
    for what, content in damaged.items():
        path.write_bytes(content)
        with pytest.raises((ValueError, EOFError)):
            Tree.load(path)
            pytest.fail(f"{what}: loaded")


def test_large_tree() -> None:
    shards, per_shard, dirs = 4, 50_000, 200
    indexes = []
    began = time.monotonic()
    for s in range(shards):
        index = ShardIndex(size=1 << 40)
        for k in range(per_shard):
            n = s * per_shard + k
            index.add(Member(b"train/c%03d/img_%07d.jpg" % (n % dirs, n), "f", n * 1024 + 512,
                             n % 1000, 5, 0o644))
        indexes.append(index)
    tree = build_tree(indexes)
    assert tree.report.members == shards * per_shard
    assert tree.count_files() == shards * per_shard
    assert len(tree) == 1 + 1 + dirs + shards * per_shard
    train = tree.resolve(b"train")
    assert len(tree.list_dir(train)) == dirs
    assert all(len(tree.list_dir(c)) == shards * per_shard // dirs for c in tree.list_dir(train))
    for n in range(0, shards * per_shard, 1000):
        path = b"train/c%03d/img_%07d.jpg" % (n % dirs, n)
        ino = tree.resolve(path)
        assert ino is not None and tree.path(ino) == path
        ref = tree.file_ref(ino)
        assert (ref.shard, ref.offset, ref.size) == (n // per_shard, n * 1024 + 512, n % 1000)
    assert time.monotonic() - began < 15
