"""Other projects' tar test archives (../shared/tar-corpus): shardfs serves what GNU tar extracts.

Every archive is extracted by GNU tar into a temp dir (the reference), then indexed by shardfs
and every regular file and symlink compared: bytes read through the real reader from a
file:// source (the catalog layer, no FUSE, for the bulk), and a sample of archives through
real FUSE mounts, several archives in one daemon. Archives GNU tar cannot read must give one
clear error. Files larger than SAMPLE_ABOVE (sparse files of 10 to 60 GB logical size) are
compared by size and sampled ranges only; GNU tar extracts those as sparse files, so the
reference costs no disk. The corpus is third-party test data: it is read in place, never
copied into this repository (origins and licences: MANIFEST.tsv).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
import shutil
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from shardfs.cache.shardcache import ShardCache, shard_key
from shardfs.catalog.catalog import Catalog, scan_local_file, stat_all
from shardfs.catalog.codecs import CodecError, codec_for
from shardfs.catalog.shardindex import KIND_DIR, KIND_FILE, KIND_LINK, ShardIndex
from shardfs.catalog.sparse import SparseMap
from shardfs.catalog.tar import TarError, _symlink_inside
from shardfs.catalog.tree import ROOT, Tree, build_tree
from shardfs.read.reader import Reader
from shardfs.read.sparse import read_sparse
from shardfs.sources import Sources
from tests.conftest import Mounter
from tests.reliability import report

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "tar-corpus"
TOOLS = ("tar", "gzip", "zstd", "lz4")  # GNU tar and the decompressors it pipes from
pytestmark = pytest.mark.skipif(not CORPUS.is_dir() or not all(map(shutil.which, TOOLS)),
                                reason="needs ../shared/tar-corpus, GNU tar, gzip, zstd, lz4")

# Compressed archives whose tar is 8-9.6 GB of zeros: indexing one streams all of it (a
# compressed shard cannot be seeked), 15-30 s each, and mounting one would decompress it
# into the cache. Checked only when SHARDFS_TEST_HUGE=1 (test_huge_compressed_archives).
HUGE = ("libarchive/inline_gtar_large_8GiB.tar.zst",
        "ratarmount/sparse-file-larger-than-8GiB-followed-by-normal-file.tar.zst")
# 10,000 and 100,000 empty files: GNU tar's listing is the reference (extracting 100,000
# files takes half a minute on a busy 2-core machine, and there are no bytes to compare).
LIST_ONLY = ("ratarmount/tar-with-10-folders-with-1000-files-0B-files.tar.gz",
             "ratarmount/tar-with-100-folders-with-1000-files-0B-files.tar.gz")
SAMPLE_ABOVE = 64 << 20  # larger files: size and sampled ranges only
SAMPLE = 64 * 1024
DECOMPRESS = {"gzip": "gzip -dc", "zstd": "zstd -dc", "lz4": "lz4 -dc"}

# Where shardfs deliberately differs from GNU tar 1.34 (README "Limits", docs/design.md);
# archive -> (why, paths allowed to differ). Symlinks that leave the tree are refused
# everywhere (a mount invariant), which the comparison checks on its own.
KNOWN: dict[str, tuple[str, set[bytes]]] = {
    "golang/pax-global-records.tar": (
        "an empty 'path=' in a later global header unsets the global path (POSIX, Go); GNU tar "
        "takes it as an empty name and fails on file3 and file4", {b"file3", b"file4"}),
    "golang/sparse-formats.tar": (
        "GNU tar stops with 'Unexpected EOF' inside Go's hand-made sparse-gnu member; we serve "
        "all five members, equal to what tarfile and Go read (md5 6f53234398c2449f...)",
        {b"sparse-gnu", b"sparse-posix-0.0", b"sparse-posix-0.1", b"sparse-posix-1.0", b"end"}),
    "libarchive/test_read_format_gtar_sparse_1_17_posix10_modified.tar": (
        "comment lines in a pax 1.0 sparse map: GNU tar reports a malformed sparse member and "
        "leaves a damaged file; we skip the member (counted as bad-sparse-map)", {b"sparse"}),
    "ratarmount/updated-file-implicitly-with-folder.tar": (
        "a file later used as a directory: GNU tar cannot create foo/fighter under the file "
        "foo; the tree makes foo a directory (the newest member wins, as in ratarmount)",
        {b"foo", b"foo/fighter", b"bar/par/sora", b"bar/par/sora/natsu"}),
}
# GNU tar 1.34 drops the final 1-byte hole of this sparse file when extracting; its own
# listing (tar -tv), libarchive and the pax GNU.sparse.realsize say 10737418244 bytes.
KNOWN_SIZE = {("libarchive/test_read_format_gtar_sparse_skip_entry.tar", b"a"): 10737418244}


def origin_md5s() -> dict[str, dict[bytes, str]]:
    """ratarmount's own expected md5s (ORIGIN_CHECKS.tsv): archive -> member path -> md5.
    Paths of ratarmount's views ('.versions/N', members of nested archives) match nothing
    here and are not checked."""
    out: dict[str, dict[bytes, str]] = {}
    for line in (CORPUS / "ORIGIN_CHECKS.tsv").read_text().splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) != 3 or fields[0] == "file":
            continue
        out.setdefault(fields[0], {})[fields[1].encode()] = fields[2]
    return out


def corpus_archives() -> list[str]:
    return sorted(p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*")
                  if p.is_file() and not p.name.endswith(".tsv"))


@dataclass
class Reference:
    """What GNU tar extracted: regular files (path -> extracted file, None when only listed)
    with their sizes, and symlinks."""

    rc: int
    stderr: str
    files: dict[bytes, Path | None] = field(default_factory=dict)
    sizes: dict[bytes, int] = field(default_factory=dict)
    links: dict[bytes, bytes] = field(default_factory=dict)


ORIGIN_MD5 = origin_md5s() if CORPUS.is_dir() else {}


def gnu_tar(archive: Path, args: str) -> subprocess.CompletedProcess:
    tool = DECOMPRESS.get(codec_for(archive.name) or "")
    source = f"{tool} < {shlex.quote(str(archive))} | tar -f -" if tool \
        else f"tar -f {shlex.quote(str(archive))}"
    # No pipefail: gzip's "trailing garbage ignored" (and lz4's complaint about it) is a
    # warning; GNU tar's own status says whether the archive was read.
    return subprocess.run(["bash", "-c", f"{source} {args} --warning=no-unknown-keyword"],
                          capture_output=True, timeout=120)


def gnu_list(archive: Path) -> Reference:
    """GNU tar's listing of an archive of empty files and directories."""
    result = gnu_tar(archive, "-tv")
    ref = Reference(result.returncode, result.stderr.decode(errors="replace").strip())
    for line in result.stdout.splitlines():
        perms, _, size, _, _, name = line.split(maxsplit=5)
        if perms.startswith(b"-"):
            assert int(size) == 0, line  # bytes are compared only through an extraction
            ref.files[name], ref.sizes[name] = None, 0
        else:
            assert perms.startswith(b"d"), line
    return ref


def gnu_extract(archive: Path, dest: Path) -> Reference:
    dest.mkdir(parents=True)
    result = gnu_tar(archive, f"-x -C {shlex.quote(str(dest))} --no-same-owner")
    ref = Reference(result.returncode, result.stderr.decode(errors="replace").strip())
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in filenames + dirnames:
            path = Path(dirpath, name)
            rel = os.fsencode(path.relative_to(dest))
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                ref.links[rel] = os.readlink(os.fsencode(path))
            elif stat.S_ISREG(mode):
                ref.files[rel], ref.sizes[rel] = path, path.stat().st_size
    return ref


def tree_entries(tree: Tree) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
    files: dict[bytes, int] = {}
    links: dict[bytes, bytes] = {}
    stack = [(ROOT, b"")]
    while stack:
        ino, prefix = stack.pop()
        for child in tree.list_dir(ino):
            path = prefix + tree.name(child)
            kind = tree.kind[child - 1]
            if kind == KIND_DIR:
                stack.append((child, path + b"/"))
            elif kind == KIND_LINK:
                links[path] = tree.links.get(child - 1, b"")
            elif kind == KIND_FILE:
                files[path] = child
    return files, links


def sample_offsets(size: int, runs: list[int] | None, seed: bytes) -> list[int]:
    """Where to compare a large file: both ends, the middle, around every data run's edges
    (holes and data meet there), and a few random places."""
    points = {0, size // 2, max(0, size - SAMPLE)}
    for start, length in zip((runs or [])[0::2], (runs or [])[1::2], strict=True):
        for edge in (start, start + length):
            points.update((max(0, edge - SAMPLE // 2), max(0, edge - 1)))
    rng = random.Random(seed)
    points.update(rng.randrange(size) for _ in range(8))
    return sorted(p for p in points if p < size)


@dataclass
class Tally:
    archives: int = 0
    gnu_reads: int = 0
    gnu_fails: int = 0
    served: int = 0
    refused: int = 0
    files: int = 0
    sparse_files: int = 0
    sampled_files: int = 0
    bytes_compared: int = 0
    symlinks: int = 0
    symlinks_refused: int = 0
    known_differences: int = 0
    origin_md5s_checked: int = 0  # files also checked against ratarmount's expected md5
    problems: list[str] = field(default_factory=list)


Read = Callable[[int, int, int], Awaitable[bytes]]  # (handle, offset, size) -> bytes


@dataclass
class View:
    """shardfs's view of an archive: from its tree, or from a mounted directory."""

    files: dict[bytes, int]  # path -> handle (inode)
    links: dict[bytes, bytes]
    size: Callable[[int], int]
    runs: Callable[[int], SparseMap | None]  # sparse map, where known
    read: Read


def tree_view(tree: Tree, read: Read) -> View:
    files, links = tree_entries(tree)
    return View(files, links, lambda ino: tree.size[ino - 1],
                lambda ino: tree.sparse.get(ino - 1), read)


async def compare(name: str, ref: Reference, view: View, tally: Tally) -> None:
    """Check shardfs's view of an archive against GNU tar's extraction."""
    files, links = view.files, view.links
    allowed = KNOWN.get(name, ("", set()))[1]
    tally.known_differences += len(allowed & (set(files) | set(ref.files)))
    problems = tally.problems
    gnu_ok = ref.rc == 0
    for path in sorted(set(ref.files) | set(files)):
        if path in allowed:
            continue
        if path not in files:
            problems.append(f"{name}: {path!r} extracted by GNU tar is missing")
            continue
        if path not in ref.files:
            if gnu_ok:  # when GNU tar fails, the members it failed on are not in ref
                problems.append(f"{name}: {path!r} is not in GNU tar's extraction")
            continue
        ino = files[path]
        size = view.size(ino)
        want_size = KNOWN_SIZE.get((name, path), ref.sizes[path])
        tally.files += 1
        runs = view.runs(ino)
        tally.sparse_files += runs is not None
        if size != want_size:
            problems.append(f"{name}: {path!r} has {size} bytes, GNU tar {want_size}")
            continue
        if not size:
            continue  # nothing to read (100,000 of these in one archive)
        gnu_copy = ref.files[path]
        assert gnu_copy is not None
        with open(gnu_copy, "rb") as f:
            if size <= SAMPLE_ABOVE:
                got, want = await view.read(ino, 0, size + 1), f.read()
                tally.bytes_compared += len(want)
                if got != want:
                    problems.append(f"{name}: {path!r} bytes differ")
                md5 = ORIGIN_MD5.get(name, {}).get(path)
                if md5 is not None:
                    tally.origin_md5s_checked += 1
                    if hashlib.md5(got).hexdigest() != md5:
                        problems.append(f"{name}: {path!r} md5 differs from ratarmount's")
                continue
            tally.sampled_files += 1
            for off in sample_offsets(size, list(runs.runs) if runs else None, path):
                got, want = await view.read(ino, off, SAMPLE), os.pread(f.fileno(), SAMPLE, off)
                if (name, path) in KNOWN_SIZE:  # GNU tar's copy lacks the final hole
                    want = want.ljust(len(got), b"\0")
                tally.bytes_compared += len(want)
                if got != want:
                    problems.append(f"{name}: {path!r} bytes differ at {off}")
                    break
    for path in sorted(set(ref.links) | set(links)):
        if path in allowed:
            continue
        target = ref.links.get(path)
        if target is not None and not _symlink_inside(path, target):
            tally.symlinks_refused += 1  # a mount invariant: nothing leads out of the tree
            if path in links:
                problems.append(f"{name}: symlink {path!r} -> {target!r} leaves the tree")
        elif links.get(path) != target and (gnu_ok or target is not None):
            problems.append(f"{name}: symlink {path!r}: {links.get(path)!r}, GNU {target!r}")
        else:
            tally.symlinks += 1


async def read_through_reader(tmp_path: Path, archives: list[str], indexes: list[ShardIndex],
                              refs: list[Reference], tally: Tally) -> None:
    """One reader over all archives (shard i = archive i), a tree per archive."""
    sources = Sources()
    cache = ShardCache(tmp_path / "cache", 4 << 30)
    cache.open()
    try:
        infos = await stat_all([(CORPUS / a).as_uri() for a in archives], sources)
        catalog = Catalog(shards=infos, keys=[shard_key(i.identity) for i in infos],
                          sha256=[ix.sha256 for ix in indexes], tree=build_tree([]),
                          codecs=[ix.compression for ix in indexes],
                          data_sizes=[ix.data_size for ix in indexes])
        reader = Reader(catalog, cache, sources)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            for shard, (name, index, ref) in enumerate(zip(archives, indexes, refs,
                                                           strict=True)):
                tree = build_tree([index])

                async def read(ino: int, off: int, size: int, tree: Tree = tree,
                               shard: int = shard) -> bytes:
                    ref = tree.file_ref(ino)
                    ref.shard = shard
                    runs = tree.sparse.get(ino - 1)
                    if runs is not None:
                        return await read_sparse(reader, ref, runs, off, size)
                    return await reader.read(shard, ref.offset, ref.size, off, size)

                await compare(name, ref, tree_view(tree, read), tally)
            nursery.cancel_scope.cancel()
    finally:
        await sources.aclose()
        cache.close()


def test_corpus_matches_gnu_tar(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    tally = Tally()
    served: list[tuple[str, ShardIndex, Reference]] = []
    skipped: Counter[str] = Counter()
    for i, name in enumerate(a for a in corpus_archives() if a not in HUGE):
        tally.archives += 1
        ref = gnu_list(CORPUS / name) if name in LIST_ONLY \
            else gnu_extract(CORPUS / name, tmp_path / "ref" / str(i))
        if ref.rc == 0:
            tally.gnu_reads += 1
        else:
            tally.gnu_fails += 1
        try:
            index = scan_local_file(str(CORPUS / name))
        except (TarError, CodecError) as exc:
            tally.refused += 1
            message = str(exc)
            if ref.rc == 0:
                tally.problems.append(f"{name}: GNU tar reads it, shardfs refuses: {message}")
            elif "\n" in message or not message:
                tally.problems.append(f"{name}: error is not one clear line: {message!r}")
            continue
        tally.served += 1
        skipped.update(index.skipped)
        served.append((name, index, ref))
    trio.run(read_through_reader, tmp_path, *map(list, zip(*served, strict=True)), tally)
    numbers = {k: v for k, v in vars(tally).items() if k != "problems"}
    report(request, "tar corpus (issue #14)", **numbers, problems=len(tally.problems),
           skipped=dict(sorted(skipped.items())))
    assert not tally.problems, "\n".join(tally.problems)
    assert tally.gnu_reads >= 150 and tally.sparse_files >= 30 and tally.sampled_files >= 3
    assert tally.origin_md5s_checked >= 20


# -- real FUSE mounts ------------------------------------------------------------------------

# Archives with disjoint paths, mounted together in one daemon per group.
MOUNT_GROUPS = [
    ["golang/gnu-sparse-big.tar", "golang/pax-sparse-big.tar", "libarchive/test_leading_slash.tar",
     "ratarmount/sparse.pax.sparse-1.0.tar", "libarchive/test_compat_lz4_3.tar.lz4",
     "cpython/testtar.tar", "libarchive/test_read_format_gtar_sparse_1_17_posix00.tar"],
    ["libarchive/test_compat_gzip_2.tgz", "libarchive/test_read_format_tar_pax_large_attr.tar.gz",
     "ratarmount/sparse.gnu.tar", "libarchive/test_read_format_tar_pax_timestamps.tar"],
]


def mounted_view(root: bytes) -> View:
    """Walk a mount (not shardfs's tree): names, kinds, sizes, link targets; reads by pread."""
    files: dict[bytes, int] = {}
    links: dict[bytes, bytes] = {}
    paths: dict[int, bytes] = {}
    sizes: dict[int, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for fname in filenames + dirnames:
            full = os.path.join(dirpath, fname)
            rel = os.path.relpath(full, root)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                links[rel] = os.readlink(full)
            elif stat.S_ISREG(st.st_mode):
                files[rel] = st.st_ino
                paths[st.st_ino] = full
                sizes[st.st_ino] = st.st_size

    async def read(ino: int, off: int, size: int) -> bytes:
        fd = os.open(paths[ino], os.O_RDONLY)
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)

    return View(files, links, sizes.__getitem__, lambda ino: None, read)


def test_mounts_match_gnu_tar(tmp_path: Path, mounter: Mounter,
                              request: pytest.FixtureRequest) -> None:
    tally = Tally()
    for g, group in enumerate(MOUNT_GROUPS):
        merged = Reference(0, "")
        for i, name in enumerate(group):
            ref = gnu_extract(CORPUS / name, tmp_path / f"ref{g}" / str(i))
            assert ref.rc == 0, ref.stderr
            assert not (set(ref.files) | set(ref.links)) & (set(merged.files) | set(merged.links))
            merged.files.update(ref.files)
            merged.sizes.update(ref.sizes)
            merged.links.update(ref.links)
        m = mounter.mount([str(CORPUS / name) for name in group])
        before = tally.files
        trio.run(compare, f"mount of {group}", merged, mounted_view(os.fsencode(m.mountpoint)),
                 tally)
        assert tally.files - before == len(merged.files)
        if g == 0:
            assert "leading-slash-removed" in m.stderr + m.log()  # counted in the log
        m.unmount()
    report(request, "tar corpus mounted (issue #14)", mounts=len(MOUNT_GROUPS),
           archives=sum(map(len, MOUNT_GROUPS)), files=tally.files,
           sampled_files=tally.sampled_files, bytes_compared=tally.bytes_compared,
           symlinks=tally.symlinks, problems=len(tally.problems))
    assert not tally.problems, "\n".join(tally.problems)
    assert tally.sampled_files >= 2  # the two 60 GB sparse files, through FUSE


def test_unreadable_archive_fails_the_mount_cleanly(mounter: Mounter) -> None:
    for name, expect in [("ratarmount/truncated.tar", "truncated"),
                         ("golang/pax-bad-hdr-file.tar", "pax header")]:
        mnt, cache = mounter.paths()
        result = mounter.run(str(CORPUS / name), str(mnt), "--cache-dir", str(cache))
        assert result.returncode != 0
        assert result.stderr.count("shardfs: error:") == 1, result.stderr
        assert expect in result.stderr and name.split("/")[1] in result.stderr, result.stderr
        assert not os.path.ismount(mnt)


_SCAN_IN_CHILD = """
import json, resource, sys
from shardfs.catalog.catalog import scan_local_file
index = scan_local_file(sys.argv[1])
print(json.dumps({"members": [[p.decode(), index.sizes[i]] for i, p in enumerate(index.paths)],
                  "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


@pytest.mark.skipif(os.environ.get("SHARDFS_TEST_HUGE") != "1",
                    reason="streams 18 GB of zeros (about a minute): set SHARDFS_TEST_HUGE=1")
@pytest.mark.parametrize("name", HUGE)
def test_huge_compressed_archives(name: str) -> None:
    """8-9.6 GB of tar inside 300 KB of zstd: indexed with bounded memory (output goes to
    the scanner in bounded pieces), members and sizes as GNU tar lists them."""
    result = subprocess.run([sys.executable, "-c", _SCAN_IN_CHILD, str(CORPUS / name)],
                            capture_output=True, text=True, timeout=600, check=True)
    scanned = json.loads(result.stdout)
    listing = gnu_tar(CORPUS / name, "-tv")
    assert listing.returncode == 0
    want = [[line.split(maxsplit=5)[5].decode(), int(line.split()[2])]
            for line in listing.stdout.splitlines()]
    assert scanned["members"] == want
    assert scanned["rss_kb"] < 1 << 20  # under 1 GiB (it was 15 GB before the pieces)
