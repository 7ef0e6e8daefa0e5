"""The namespace: a compact, immutable inode table built from every shard's member list.

Entries are numbered in depth-first order of sorted paths (inode = position + 1, root = 1).
Everything lives in flat arrays and one names blob, not in per-member Python objects, so a
1.3 M member tree costs tens of MB. A directory's children are a contiguous, name-sorted run
of `children`, so lookup is a binary search and readdir a slice.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import stat
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shardfs.catalog.shardindex import KIND_DIR, KIND_FILE, KIND_LINK, Packed, ShardIndex
from shardfs.catalog.sparse import SparseMap, decode_map, encode_map

log = logging.getLogger(__name__)

ROOT = 1
# /2: sparse members (a tree cached by /1 may lack them: its key differs, so it is rebuilt).
# /3: compressed members (zip, split RecordIO records): the `packed` side table.
TREE_FORMAT = "shardfs-tree/3"
_SEP = b"\0"  # sorts below every name byte, so sorted keys give a component-wise order


@dataclass(slots=True)
class BuildReport:
    members: int = 0
    shadowed: int = 0  # paths also present in a later shard (the later one wins)
    conflicts: int = 0  # a file that is also used as a directory by other members
    dangling_links: int = 0  # symlinks whose target is not in the tree


@dataclass(slots=True)
class FileRef:
    shard: int
    offset: int
    size: int


@dataclass(slots=True)
class Tree:
    names: bytes  # all entry names, concatenated
    name_end: array  # Q: end of entry i's name in `names`
    parent: array  # I: parent entry position
    kind: bytearray  # KIND_FILE / KIND_DIR / KIND_LINK
    shard: array  # I
    offset: array  # Q
    size: array  # Q
    mtime: array  # q
    mode: array  # H
    children: array  # I: entry positions, grouped per directory, sorted by name
    child_start: array  # I: per entry, first index into `children` (dirs only)
    child_count: array  # I: per entry, number of children (dirs only)
    links: dict[int, bytes] = field(default_factory=dict)
    # Entry position -> sparse map, for the (rare) sparse files only; `size` is then the
    # logical size and the data runs are stored back to back from `offset`.
    sparse: dict[int, SparseMap] = field(default_factory=dict)
    # Entry position -> (codec, stored size, CRC-32) for compressed members (zip deflate,
    # split RecordIO records): `size` is the decoded size, the stored bytes start at `offset`.
    packed: dict[int, Packed] = field(default_factory=dict)
    report: BuildReport = field(default_factory=BuildReport)

    def __len__(self) -> int:
        return len(self.kind)

    # -- queries (inode numbers in, inode numbers out) ---------------------------------
    def valid(self, ino: int) -> bool:
        return 1 <= ino <= len(self.kind)

    def name(self, ino: int) -> bytes:
        i = ino - 1
        start = self.name_end[i - 1] if i else 0
        return self.names[start : self.name_end[i]]

    def is_dir(self, ino: int) -> bool:
        return self.kind[ino - 1] == KIND_DIR

    def lookup(self, parent: int, name: bytes) -> int | None:
        p = parent - 1
        if self.kind[p] != KIND_DIR:
            return None
        lo = self.child_start[p]
        hi = lo + self.child_count[p]
        children, name_end, names = self.children, self.name_end, self.names
        while lo < hi:
            mid = (lo + hi) // 2
            c = children[mid]
            start = name_end[c - 1] if c else 0
            candidate = names[start : name_end[c]]
            if candidate < name:
                lo = mid + 1
            elif candidate > name:
                hi = mid
            else:
                return c + 1
        return None

    def list_dir(self, ino: int, start: int = 0) -> Sequence[int]:
        """Child inodes of a directory from position `start` on (positions are stable)."""
        p = ino - 1
        first = self.child_start[p]
        return [c + 1 for c in self.children[first + start : first + self.child_count[p]]]

    def file_ref(self, ino: int) -> FileRef:
        i = ino - 1
        return FileRef(self.shard[i], self.offset[i], self.size[i])

    def stored_size(self, ino: int) -> int:
        """Bytes a file takes in its shard: its size, or its data runs' if it is sparse, or
        its stored (compressed) size."""
        if self.packed and ino - 1 in self.packed:
            return self.packed[ino - 1][1]
        smap = self.sparse.get(ino - 1) if self.sparse else None
        return self.size[ino - 1] if smap is None else smap.stored

    def path(self, ino: int) -> bytes:
        parts = []
        while ino != ROOT:
            parts.append(self.name(ino))
            ino = self.parent[ino - 1] + 1
        return b"/".join(reversed(parts))

    def resolve(self, path: bytes) -> int | None:
        ino: int | None = ROOT
        for part in path.split(b"/"):
            if part and part != b"." and ino is not None:
                ino = self.lookup(ino, part)
        return ino

    def st_mode(self, ino: int) -> int:
        i = ino - 1
        kind = self.kind[i]
        if kind == KIND_DIR:
            return stat.S_IFDIR | 0o555
        if kind == KIND_LINK:
            return stat.S_IFLNK | 0o777
        # Read-only mount: drop write bits, keep exec bits, always readable.
        return stat.S_IFREG | 0o444 | (self.mode[i] & 0o111)

    def st_size(self, ino: int) -> int:
        i = ino - 1
        if self.kind[i] == KIND_LINK:
            return len(self.links.get(i, b""))
        return self.size[i] if self.kind[i] == KIND_FILE else 0

    def shards_under(self, ino: int) -> list[int]:
        """Shards holding the files at or below `ino`, in order of first appearance."""
        seen: dict[int, None] = {}
        stack = [ino]
        while stack:
            i = stack.pop() - 1
            kind = self.kind[i]
            if kind == KIND_FILE:
                seen.setdefault(self.shard[i], None)
            elif kind == KIND_DIR:
                first = self.child_start[i]
                stack.extend(c + 1 for c in self.children[first : first + self.child_count[i]])
        return list(seen)

    def count_files(self) -> int:
        return self.kind.count(KIND_FILE)

    def files_by_shard(self, shards: int) -> tuple[array, array]:
        """The plain (not sparse, not compressed) files grouped by shard, each group in offset
        order: shard k's entry positions are `order[start[k]:start[k + 1]]`. Flat arrays
        (4 bytes per file), like the rest of the tree."""
        kind, shard, offset, sparse = self.kind, self.shard, self.offset, self.sparse
        packed = self.packed
        files = [i for i in range(len(kind))
                 if kind[i] == KIND_FILE and i not in sparse and i not in packed]
        files.sort(key=lambda i: (shard[i], offset[i]))
        start = array("I", bytes(4 * (shards + 1)))
        for i in files:
            start[shard[i] + 1] += 1
        for k in range(shards):
            start[k + 1] += start[k]
        return array("I", files), start

    # -- persistence --------------------------------------------------------------------
    _ARRAYS = ("name_end", "parent", "shard", "offset", "size", "mtime", "mode",
               "children", "child_start", "child_count")

    def save(self, path: Path) -> None:
        """Write atomically (temp + rename) so a crash never leaves a half tree file."""
        header = {
            "format": TREE_FORMAT,
            "entries": len(self.kind),
            "names": len(self.names),
            "arrays": {n: [getattr(self, n).typecode, len(getattr(self, n))] for n in self._ARRAYS},
            "links": {str(k): v.hex() for k, v in self.links.items()},
            "sparse": {str(k): encode_map(v.runs).decode() for k, v in self.sparse.items()},
            "packed": {str(k): list(v) for k, v in self.packed.items()},
            "report": [self.report.members, self.report.shadowed, self.report.conflicts,
                       self.report.dangling_links],
        }
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                out.write(json.dumps(header).encode() + b"\n")
                out.write(self.names)
                out.write(self.kind)
                for n in self._ARRAYS:
                    getattr(self, n).tofile(out)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> Tree:
        """Read a saved tree; ValueError (EOFError if cut short) if damaged or of another format."""
        try:
            return cls._load(path)
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            # Parseable JSON of the wrong shape (a missing key, a list for a dict ...).
            raise ValueError(f"{path}: damaged tree file ({exc!r})") from None

    @classmethod
    def _load(cls, path: Path) -> Tree:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            if not isinstance(header, dict) or header.get("format") != TREE_FORMAT:
                raise ValueError(f"{path}: not a {TREE_FORMAT} file")
            names = f.read(header["names"])
            kind = bytearray(f.read(header["entries"]))
            arrays = {}
            for n in cls._ARRAYS:
                typecode, count = header["arrays"][n]
                arr = array(typecode)
                arr.fromfile(f, count)  # EOFError when truncated
                arrays[n] = arr
            if f.read(1):
                raise ValueError(f"{path}: trailing bytes")
        if len(names) != header["names"] or len(kind) != header["entries"]:
            raise ValueError(f"{path}: truncated")
        links = {int(k): bytes.fromhex(v) for k, v in header["links"].items()}
        sparse = {int(k): SparseMap.of(decode_map(v.encode(), arrays["size"][int(k)]))
                  for k, v in header["sparse"].items()}
        packed = {int(k): (str(v[0]), int(v[1]), int(v[2]))
                  for k, v in header["packed"].items()}
        return cls(names=names, kind=kind, links=links, sparse=sparse, packed=packed,
                   report=BuildReport(*header["report"]), **arrays)


def build_tree(shards: Sequence[ShardIndex], *, default_mtime: int = 0) -> Tree:
    """Merge shard member lists (in SOURCE order; a later shard wins a duplicate path)."""
    report = BuildReport()
    # Flat candidate list across shards, in SOURCE order; keys sort component-wise.
    keys: list[bytes] = []
    where = array("I")  # shard index of each candidate
    pos = array("I")  # position within its shard
    for s, index in enumerate(shards):
        keys.extend(p.replace(b"/", _SEP) for p in index.paths)
        where.extend([s] * len(index))
        pos.extend(range(len(index)))
    report.members = len(keys)
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: SOURCE order among equals

    names = bytearray()
    name_end, parent, shard_col = array("Q"), array("I"), array("I")
    offset, size, mtime, mode = array("Q"), array("Q"), array("q"), array("H")
    kind = bytearray()
    links: dict[int, bytes] = {}
    sparse: dict[int, SparseMap] = {}
    packed: dict[int, Packed] = {}

    def add(name: bytes, par: int, k: int, s: int, o: int, z: int, t: int, m: int) -> int:
        names.extend(name)
        name_end.append(len(names))
        parent.append(par)
        kind.append(k)
        shard_col.append(s)
        offset.append(o)
        size.append(z)
        mtime.append(t)
        mode.append(m)
        return len(kind) - 1

    add(b"", 0, KIND_DIR, 0, 0, 0, default_mtime, 0o755)
    stack_parts: list[bytes] = []  # path components of the current directory
    stack_ids = [0]  # entry positions of root and the current directory chain
    n = len(order)
    for rank, c in enumerate(order):
        key = keys[c]
        if rank + 1 < n and keys[order[rank + 1]] == key:
            report.shadowed += 1  # a later shard (or later member) holds the same path
            continue
        s, p = where[c], pos[c]
        index = shards[s]
        k = index.kinds[p]
        parts = key.split(_SEP)
        # Pop to the common prefix, then create the implied parent directories.
        common = 0
        limit = min(len(stack_parts), len(parts) - 1)
        while common < limit and stack_parts[common] == parts[common]:
            common += 1
        del stack_parts[common:]
        del stack_ids[common + 1 :]
        for part in parts[common:-1]:
            stack_ids.append(add(part, stack_ids[-1], KIND_DIR, 0, 0, 0, index.mtimes[p], 0o755))
            stack_parts.append(part)
        is_parent_of_next = rank + 1 < n and keys[order[rank + 1]].startswith(key + _SEP)
        if k != KIND_DIR and is_parent_of_next:
            report.conflicts += 1  # later members live under this name: it must be a directory
            k = KIND_DIR
        if k == KIND_DIR:
            e = add(parts[-1], stack_ids[-1], KIND_DIR, 0, 0, 0, index.mtimes[p], 0o755)
            stack_ids.append(e)
            stack_parts.append(parts[-1])
        else:
            e = add(parts[-1], stack_ids[-1], k, s, index.offsets[p], index.sizes[p],
                    index.mtimes[p], index.modes[p])
            if k == KIND_LINK:
                links[e] = index.links.get(p, b"")
            elif index.sparse and p in index.sparse:
                sparse[e] = SparseMap.of(index.sparse[p])
            elif index.packed and p in index.packed:
                packed[e] = index.packed[p]
    del keys, order, where, pos

    children, child_start, child_count = _group_children(parent, kind)
    tree = Tree(names=bytes(names), name_end=name_end, parent=parent, kind=kind,
                shard=shard_col, offset=offset, size=size, mtime=mtime, mode=mode,
                children=children, child_start=child_start, child_count=child_count,
                links=links, sparse=sparse, packed=packed, report=report)
    report.dangling_links = _count_dangling(tree)
    return tree


def _group_children(parent: array, kind: bytearray) -> tuple[array, array, array]:
    """Counting sort of entries by parent; depth-first order keeps each group name-sorted."""
    n = len(kind)
    count = array("I", bytes(4 * n))
    for i in range(1, n):
        count[parent[i]] += 1
    start = array("I", bytes(4 * n))
    total = 0
    for i in range(n):
        start[i] = total
        total += count[i]
    children = array("I", bytes(4 * total))
    fill = array("I", start)
    for i in range(1, n):
        p = parent[i]
        children[fill[p]] = i
        fill[p] += 1
    return children, start, count


def _count_dangling(tree: Tree) -> int:
    dangling = 0
    for e, target in tree.links.items():
        link_dir = posixpath.dirname(tree.path(e + 1))
        resolved = posixpath.normpath(posixpath.join(link_dir, target))
        if resolved != b"." and tree.resolve(resolved) is None:  # "." is the root
            dangling += 1
    return dangling
