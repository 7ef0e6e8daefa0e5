"""Tests for shardfs.catalog.tar: real archives from Python's tarfile and GNU tar, no mocks."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import posixpath
import random
import shutil
import subprocess
import tarfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardfs.catalog.sparse import HOLE, SparseMap, pieces
from shardfs.catalog.tar import BLOCK, Member, TarError, TarScanner, normalize_path

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}

# -- helpers ------------------------------------------------------------------------------


@dataclass
class Scan:
    members: list[Member]
    skipped: Counter[str]
    done: bool


def scan(data: bytes, chunk: int | None = None, use_skip: bool = False) -> Scan:
    """Feed `data` in chunks of `chunk` bytes (all at once if None), skipping data if asked."""
    scanner = TarScanner()
    members: list[Member] = []
    step = chunk or max(len(data), 1)
    pos = 0
    view = memoryview(data)
    while pos < len(data):
        if use_skip and scanner.skippable:
            n = min(scanner.skippable, len(data) - pos)
            scanner.skip(n)
            pos += n
            continue
        members += scanner.feed(view[pos : pos + step])
        pos += step
    scanner.finish()
    return Scan(members, scanner.skipped, scanner.done)


def data_of(archive: bytes, member: Member) -> bytes:
    if member.sparse is None:
        return archive[member.offset : member.offset + member.size]
    out = bytearray()
    for at, n in pieces(SparseMap.of(member.sparse), member.size, 0, member.size):
        start = member.offset + at
        out += bytes(n) if at == HOLE else archive[start : start + n]
    return bytes(out)


def fix_checksum(block: bytearray) -> None:
    """Rewrite the checksum of a 512-byte header the way tarfile does."""
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


def patch_header(archive: bytes, offset: int, field: slice, value: bytes) -> bytes:
    """Overwrite a header field at `offset` and fix that header's checksum."""
    out = bytearray(archive)
    block = out[offset : offset + BLOCK]
    block[field] = value.ljust(field.stop - field.start, b"\0")
    fix_checksum(block)
    out[offset : offset + BLOCK] = block
    return bytes(out)


@dataclass(frozen=True)
class Entry:
    kind: str  # f file, d dir, l symlink, h hardlink, c/b device, p fifo, 7 contiguous, Z unknown
    name: bytes
    content: bytes = b""
    target: bytes = b""
    mtime: float = 1_700_000_000
    mode: int = 0o644


_TYPES = {
    "f": tarfile.REGTYPE,
    "7": tarfile.CONTTYPE,
    "d": tarfile.DIRTYPE,
    "l": tarfile.SYMTYPE,
    "h": tarfile.LNKTYPE,
    "c": tarfile.CHRTYPE,
    "b": tarfile.BLKTYPE,
    "p": tarfile.FIFOTYPE,
    "Z": b"Z",
}


def make_tar(
    fmt: int, entries: Iterable[Entry], pax_globals: dict[str, str] | None = None
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf,
        mode="w",
        format=fmt,
        encoding="utf-8",
        errors="surrogateescape",
        pax_headers=pax_globals,
    ) as tf:
        for e in entries:
            info = tarfile.TarInfo(os.fsdecode(e.name))
            info.type = _TYPES[e.kind]
            info.mtime = e.mtime
            info.mode = e.mode
            info.linkname = os.fsdecode(e.target)
            if e.kind in "f7Z":
                info.size = len(e.content)
                tf.addfile(info, io.BytesIO(e.content))
            else:
                tf.addfile(info)
    return buf.getvalue()


def _inside(path: bytes, target: bytes) -> bool:
    """Model: the kernel follows `target` from the link's directory. Any name on the way may
    itself be a symlink (to anywhere inside), so a '..' after a name proves nothing; only
    '..'s before every name climb known directories, and never above the root."""
    if not target or target.startswith(b"/"):
        return False
    depth = len(posixpath.dirname(path).split(b"/")) if b"/" in path else 0
    seen_name = False
    for part in target.split(b"/"):
        if part in (b"", b"."):
            continue
        if part == b"..":
            if seen_name or depth == 0:
                return False
            depth -= 1
        else:
            seen_name = True
    return True


def expected(entries: Iterable[Entry]) -> tuple[dict[bytes, tuple[str, bytes]], Counter[str]]:
    """Model of what the scanner exposes (path -> (kind, data or link target)) and skips."""
    want: dict[bytes, tuple[str, bytes]] = {}
    skipped: Counter[str] = Counter()
    files: dict[bytes, bytes] = {}  # for hard links: earlier regular files
    for e in entries:
        stored = e.name + b"/" if e.kind == "d" and not e.name.endswith(b"/") else e.name
        path = normalize_path(stored)
        if path is None and stored.startswith(b"/"):  # GNU tar drops a leading '/'
            path = normalize_path(stored.lstrip(b"/"))
        is_dir = e.kind == "d" or (e.kind in "f7" and stored.endswith(b"/"))
        if e.kind in "cb":
            skipped["device"] += 1
        elif e.kind == "p":
            skipped["fifo"] += 1
        elif e.kind == "Z":
            skipped["unsupported-type-Z"] += 1
        elif path is None:
            root = is_dir and not stored.strip(b"./")
            skipped["root-dir" if root else "unsafe-name"] += 1
        elif is_dir:
            files.pop(path, None)
            want[path] = ("d", b"")
        elif e.kind in "f7":
            files[path] = e.content
            want[path] = ("f", e.content)
        elif e.kind == "l":
            if _inside(path, e.target):
                files.pop(path, None)
                want[path] = ("l", e.target)
            else:
                skipped["symlink-escapes"] += 1
        elif e.kind == "h":
            target = normalize_path(e.target.lstrip(b"/"))
            if target is not None and target in files:
                files[path] = files[target]
                want[path] = ("f", files[target])
            else:
                skipped["hardlink-missing-target"] += 1
    return want, skipped


def check(archive: bytes, result: Scan, want: dict[bytes, tuple[str, bytes]]) -> None:
    got: dict[bytes, tuple[str, bytes]] = {}
    for m in result.members:
        assert normalize_path(m.path) == m.path
        assert m.offset + m.size <= len(archive)
        got[m.path] = (m.kind, data_of(archive, m) if m.kind == "f" else m.linkname)
        if m.kind != "f":
            assert m.size == 0
    assert got == want


LONG_DIR = b"/".join([b"deep%02d" % i for i in range(30)])  # 209 bytes of directories
ENTRIES = [
    Entry("d", b"top"),
    Entry("f", b"top/a.txt", b"hello\n"),
    Entry("f", b"./top/dot-prefixed.bin", bytes(range(256)) * 3),
    Entry("f", b"top/empty", b""),
    Entry("f", b"top/exact-block", b"x" * 512),
    Entry("f", b"top/block-plus-one", b"y" * 513),
    Entry("f", "top/ünïcødé-名前.txt".encode(), "ü".encode() * 100),
    Entry("f", b"top/not-utf8-\xff\xfe.bin", b"\xff" * 7),
    Entry("7", b"top/contiguous", b"contiguous data"),
    Entry("f", b"p" * 120 + b"/prefix-field-name.txt", b"prefix"),  # > 100: ustar prefix
    Entry("l", b"top/link-in", target=b"a.txt"),
    Entry("l", b"top/link-up-in", target=b"../top/a.txt"),
    Entry("l", b"top/link-out", target=b"../../etc/passwd"),
    Entry("l", b"top/link-abs", target=b"/etc/passwd"),
    Entry("h", b"top/hard", target=b"top/a.txt"),
    Entry("h", b"top/hard-dot", target=b"./top/dot-prefixed.bin"),
    Entry("h", b"top/hard-missing", target=b"top/nope"),
    Entry("h", b"top/hard-to-later", target=b"top/later"),
    Entry("f", b"top/later", b"later"),
    Entry("c", b"dev/null"),
    Entry("b", b"dev/sda"),
    Entry("p", b"dev/fifo"),
    Entry("Z", b"top/unknown-type", b"data of an unknown member type"),
    Entry("f", b"../escape.txt", b"evil"),
    Entry("f", b"/abs.txt", b"evil"),
    Entry("f", b"top/../../escape2", b"evil"),
    Entry("f", b"top/last", b"the end"),
]
LONG_ENTRIES = [
    Entry("f", b"top/" + b"n" * 150, b"long name > 100"),
    Entry("f", LONG_DIR + b"/" + b"m" * 100, b"long name > 255"),
    Entry("l", b"top/long-link", target=b"../" + LONG_DIR + b"/" + b"m" * 100),
    Entry("h", b"top/long-hard", target=LONG_DIR + b"/" + b"m" * 100),
    Entry("f", b"q" * 300, b"single component > 255"),
]


# -- tarfile archives -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
def test_tarfile_formats(fmt: str) -> None:
    entries = ENTRIES + ([] if fmt == "ustar" else LONG_ENTRIES)
    archive = make_tar(FORMATS[fmt], entries)
    want, skipped = expected(entries)
    result = scan(archive)
    check(archive, result, want)
    assert result.skipped == skipped
    assert result.done
    by_path = {m.path: m for m in result.members}
    assert by_path[b"top/a.txt"].mtime == 1_700_000_000
    assert by_path[b"top/a.txt"].mode == 0o644
    # Hard links keep their own path but point at the target's data.
    assert by_path[b"top/hard"].offset == by_path[b"top/a.txt"].offset
    assert by_path[b"top/long-hard" if fmt != "ustar" else b"top/hard"].kind == "f"


def test_duplicates_are_all_yielded() -> None:
    entries = [Entry("f", b"a", b"one"), Entry("f", b"./a", b"two"), Entry("f", b"a/", b"")]
    archive = make_tar(tarfile.GNU_FORMAT, entries)
    members = scan(archive).members
    assert [(m.path, m.kind) for m in members] == [(b"a", "f"), (b"a", "f"), (b"a", "d")]
    assert [data_of(archive, m) for m in members[:2]] == [b"one", b"two"]


def test_mode_mask_and_mtimes() -> None:
    entries = [
        Entry("f", b"suid", b"x"),
        Entry("f", b"neg", b"x", mtime=-100),  # GNU: base-256 negative mtime
        Entry("f", b"big", b"x", mtime=8**11),  # GNU: base-256
        Entry("f", b"huge", b"x", mtime=8**12),  # clamped so that st_mtime_ns fits int64
    ]
    archive = make_tar(tarfile.GNU_FORMAT, entries)
    archive = patch_header(archive, 0, slice(100, 108), b"0104755\0")  # tarfile masks modes
    members = scan(archive).members
    assert [m.mode for m in members] == [0o4755, 0o644, 0o644, 0o644]
    assert [m.mtime for m in members] == [1_700_000_000, -100, 8**11, 2**33]


def test_pax_fractional_mtime_is_floored() -> None:
    entries = [
        Entry("f", b"pos", b"x", mtime=1_700_000_000.75),
        Entry("f", b"neg", b"x", mtime=-1.5),
    ]
    members = scan(make_tar(tarfile.PAX_FORMAT, entries)).members
    assert [m.mtime for m in members] == [1_700_000_000, -2]


def test_pax_global_header_applies_to_following_members() -> None:
    entries = [Entry("f", b"a", b"x"), Entry("f", b"b", b"y", mtime=5.5), Entry("f", b"c", b"z")]
    archive = make_tar(tarfile.PAX_FORMAT, entries, pax_globals={"mtime": "1234", "comment": "c"})
    members = scan(archive).members
    # 'x' wins over 'g' for b; c, after it, still gets the global value.
    assert [(m.path, m.mtime) for m in members] == [(b"a", 1234), (b"b", 5), (b"c", 1234)]


def test_directories_keep_mtime_and_mode() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("d", b"top", mtime=1234, mode=0o750),
                                            Entry("f", b"top/f", b"x", mtime=99, mode=0o640)])
    assert [(m.path, m.kind, m.mtime, m.mode) for m in scan(archive).members] == [
        (b"top", "d", 1234, 0o750), (b"top/f", "f", 99, 0o640)]


def test_pax_size_overrides_header_size() -> None:
    info = tarfile.TarInfo("big")
    info.size = 5
    info.pax_headers = {"size": "5"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(b"12345"))
        tf.addfile(tarfile.TarInfo("after"), io.BytesIO(b""))
    archive = buf.getvalue()
    # The ustar header follows the pax header and its data; its size field now says 0.
    header = archive.index(b"big\0", BLOCK)
    archive = patch_header(archive, header, slice(124, 136), b"%011o\0" % 0)
    members = scan(archive).members
    assert [(m.path, data_of(archive, m)) for m in members] == [(b"big", b"12345"), (b"after", b"")]


def test_base256_size() -> None:
    archive = make_tar(tarfile.USTAR_FORMAT, [Entry("f", b"a", b"hello"), Entry("f", b"b", b"")])
    archive = patch_header(archive, 0, slice(124, 136), b"\x80" + (5).to_bytes(11, "big"))
    members = scan(archive).members
    assert [(m.path, data_of(archive, m)) for m in members] == [(b"a", b"hello"), (b"b", b"")]


def test_signed_checksum_is_accepted() -> None:
    archive = bytearray(make_tar(tarfile.USTAR_FORMAT, [Entry("f", "é".encode(), b"x")]))
    signed = tarfile.calc_chksums(bytes(archive[:BLOCK]))[1]
    archive[148:156] = b"%06o\0 " % signed
    assert [m.path for m in scan(bytes(archive)).members] == ["é".encode()]


def test_v7_directory_as_trailing_slash() -> None:
    # Old tars had no directory type: a regular member named "x/" is a directory.
    archive = make_tar(tarfile.USTAR_FORMAT, [Entry("f", b"olddir/", b""), Entry("f", b"f", b"1")])
    archive = patch_header(archive, 0, slice(257, 265), b"")  # no magic: v7
    archive = patch_header(archive, 0, slice(156, 157), b"\0")
    members = scan(archive).members
    assert [(m.path, m.kind) for m in members] == [(b"olddir", "d"), (b"f", "f")]


def test_root_dir_entry_is_not_unsafe() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("d", b"."), Entry("d", b"./"), Entry("d", b"/")])
    result = scan(archive)
    assert result.members == []
    assert result.skipped == Counter({"root-dir": 3})


def test_malformed_pax_sparse_is_skipped_and_resyncs() -> None:
    info = tarfile.TarInfo("sparse")
    info.size = 3
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(b"abc"))
        tf.addfile(tarfile.TarInfo("next"), io.BytesIO(b""))
    result = scan(buf.getvalue())
    assert [m.path for m in result.members] == [b"next"]
    assert result.skipped == Counter({"bad-sparse-map": 1})  # no GNU.sparse.realsize


def _symlinks(entries: list[tuple[str, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, target in entries:
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
    return buf.getvalue()


def test_symlink_through_symlink_cannot_escape() -> None:
    # Lexically "l/.." is "d", but the kernel follows d/l (-> the root) first and then goes
    # up out of the mount. Found by the hostile corpus (issue #7).
    result = scan(_symlinks([("d/l", ".."), ("d/l2", "l/.."), ("d/l3", "l/../etc/passwd"),
                             ("x", "d/l/d/l/.."), ("d/ok", "../d/./l"), ("e/f/ok2", "../../x"),
                             ("up", "a/b/../c")]))
    assert {m.path: m.linkname for m in result.members} == {
        b"d/l": b"..", b"d/ok": b"../d/./l", b"e/f/ok2": b"../../x"}
    assert result.skipped == Counter({"symlink-escapes": 4})


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (b"a", b"a"),
        (b"./a/./b//c/", b"a/b/c"),
        (b"././a", b"a"),
        (b"a/.", b"a"),
        (b"a/..b/c..", b"a/..b/c.."),
        (b"\xff\xfe/x", b"\xff\xfe/x"),
        (b"", None),
        (b".", None),
        (b"./", None),
        (b"/a", None),
        (b"//a", None),
        (b"..", None),
        (b"a/../b", None),
        (b"a/..", None),
        (b"x" * 255, b"x" * 255),
        (b"d/" + b"x" * 255 + b"/f", b"d/" + b"x" * 255 + b"/f"),
        (b"x" * 256, None),  # longer than NAME_MAX: could hide its siblings from readdir
        (b"./d/" + b"x" * 256 + b"/f", None),
        (b"a\0b", None),
    ],
)
def test_normalize_path(raw: bytes, want: bytes | None) -> None:
    assert normalize_path(raw) == want


# -- GNU tar archives -----------------------------------------------------------------------


def _populate(root: Path, long_names: bool) -> dict[bytes, tuple[str, bytes]]:
    """Create a tree on disk; return what the scanner should expose for it."""
    want: dict[bytes, tuple[str, bytes]] = {}

    def add_file(rel: bytes, content: bytes) -> None:
        path = root / os.fsdecode(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        want[rel] = ("f", content)

    add_file(b"a.txt", b"hello")
    add_file(b"empty", b"")
    add_file("dir/ünïcødé-名前.bin".encode(), b"\x00\x01" * 700)
    add_file(b"dir/raw-\xff\xfe.bin", b"not utf-8 name")
    if long_names:
        add_file(b"l" * 150, b"long > 100")
        add_file(LONG_DIR + b"/" + b"m" * 120, b"long > 255")
    (root / "emptydir").mkdir()
    os.symlink("a.txt", root / "dir" / "in-link")
    os.symlink("../../outside", root / "dir" / "out-link")
    os.link(root / "a.txt", root / "dir" / "hard")
    want[b"dir/in-link"] = ("l", b"a.txt")
    want[b"dir/hard"] = ("f", b"hello")
    dirs = [b"dir", b"emptydir"]
    if long_names:
        dirs += [b"/".join(LONG_DIR.split(b"/")[:i]) for i in range(1, 31)]
    for d in dirs:
        want[d] = ("d", b"")
    return want


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar", "v7"])
def test_gnu_tar_formats(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    want = _populate(root, long_names=fmt in ("gnu", "pax"))
    archive = subprocess.run(
        ["tar", f"--format={fmt}", "-C", str(root), "-cf", "-", "."],
        check=True,
        capture_output=True,
    ).stdout
    for chunk, use_skip in [(None, False), (511, True), (4096, False)]:
        result = scan(archive, chunk, use_skip)
        check(archive, result, want)
        assert result.skipped == Counter({"root-dir": 1, "symlink-escapes": 1})


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("fmt", ["gnu", "posix:0.0", "posix:0.1", "posix:1.0"])
def test_gnu_tar_sparse_files_are_served(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "sparse", "wb") as f:  # 12 data runs: old GNU needs extension blocks
        for i in range(12):
            f.seek(i * 1024 * 1024 + 7)
            f.write(b"data%d" % i * 100)
        f.truncate(13 * 1024 * 1024)  # ends on a hole
    content = (root / "sparse").read_bytes()
    (root / "z-after").write_bytes(b"after the sparse file")
    fmt_name, _, version = fmt.partition(":")
    options = [f"--sparse-version={version}"] if version else []
    archive = subprocess.run(
        ["tar", f"--format={fmt_name}", "--sparse", *options, "-C", str(root), "-cf", "-",
         "sparse", "z-after"],
        check=True,
        capture_output=True,
    ).stdout
    for chunk, use_skip in [(None, False), (1000, True), (511, False)]:
        result = scan(archive, chunk, use_skip)
        got = {m.path: (m.size, data_of(archive, m)) for m in result.members}
        assert got == {b"sparse": (len(content), content),
                       b"z-after": (21, b"after the sparse file")}
        sparse = result.members[0].sparse
        assert sparse is not None and len(sparse) == 24  # 12 runs: holes are not stored
        assert result.skipped == Counter()
    assert len(archive) < len(content) // 4
    assert "truncated" in str(_error(archive[: BLOCK + 100]))


# -- chunking -----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 511, 512, 513, 4096, 1 << 20])
@pytest.mark.parametrize("use_skip", [False, True])
@pytest.mark.parametrize("fmt", ["gnu", "pax"])
def test_chunking_does_not_matter(fmt: str, chunk: int, use_skip: bool) -> None:
    entries = ENTRIES + LONG_ENTRIES + [Entry("f", b"big", os.urandom(3 * 1024 * 1024 + 7))]
    if chunk == 1:
        entries = entries[:-1]  # keep 1-byte feeding quick
    archive = make_tar(FORMATS[fmt], entries)
    whole = scan(archive)
    result = scan(archive, chunk, use_skip)
    assert result == whole
    check(archive, result, expected(entries)[0])


def test_skippable_and_skip() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"a", b"x" * 1000), Entry("f", b"b", b"")])
    scanner = TarScanner()
    assert scanner.skippable == 0
    [a] = scanner.feed(archive[: BLOCK + 10])
    assert scanner.skippable == 1024 - 10  # the rest of the data and its padding
    with pytest.raises(ValueError):
        scanner.skip(1015)
    scanner.skip(1014)
    assert [m.path for m in scanner.feed(archive[BLOCK + 1024 :])] == [b"b"]
    assert scanner.done and scanner.skippable == 0
    scanner.finish()
    assert a.offset == BLOCK and a.size == 1000


def test_bytes_after_end_are_ignored() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"a", b"x")])
    scanner = TarScanner()
    members = scanner.feed(archive[: 4 * BLOCK])
    assert scanner.done
    assert scanner.feed(b"garbage" * 1000) == []
    scanner.finish()
    assert [m.path for m in members] == [b"a"]


# -- malformed input --------------------------------------------------------------------------


def _error(data: bytes, chunk: int | None = None) -> TarError:
    with pytest.raises(TarError) as info:
        scan(data, chunk)
    return info.value


SMALL = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"a", b"x" * 1000), Entry("f", b"b", b"yz")])


def test_bad_checksum() -> None:
    corrupt = bytearray(SMALL)
    corrupt[1536] ^= 0x01  # name of the second header
    err = _error(bytes(corrupt))
    assert "bad header checksum" in str(err)
    assert err.offset == 1536


def test_bad_checksum_on_first_header() -> None:
    corrupt = bytearray(SMALL)
    corrupt[0] ^= 0x01
    assert "bad header checksum" in str(_error(bytes(corrupt)))


@pytest.mark.parametrize("cut", [100, 511, 1536 + 200])
def test_truncated_header(cut: int) -> None:
    assert _error(SMALL[:cut]).offset in (0, 1536)


@pytest.mark.parametrize("cut", [513, 1000, 1511])
def test_truncated_data(cut: int) -> None:
    assert "truncated member data" in str(_error(SMALL[:cut]))


@pytest.mark.parametrize("cut", [1512, 1536, 2050, 2560, 3000, 3072, 3584, len(SMALL)])
def test_acceptable_ends(cut: int) -> None:
    # Missing padding, missing end marker, lone zero block, partial zero block.
    assert [m.path for m in scan(SMALL[:cut]).members] == ([b"a", b"b"] if cut > 1536 else [b"a"])


def test_empty_input() -> None:
    assert "empty archive" in str(_error(b""))


def test_only_end_marker_is_an_empty_archive() -> None:
    result = scan(bytes(1024))
    assert result.members == [] and result.done
    assert scan(bytes(512)).members == []  # lone zero block, then EOF


def test_not_a_tar() -> None:
    assert "not a tar archive" in str(_error(b"hello world" * 100))
    assert "not a tar archive" in str(_error(b"hello"))
    assert "not a tar archive" in str(_error(os.urandom(4096)))


@pytest.mark.parametrize(
    ("compress", "name"),
    [
        (gzip.compress, "gzip"),
        (bz2.compress, "bzip2"),
        (lzma.compress, "xz"),
        (lambda d: b"\x28\xb5\x2f\xfd" + d, "zstd"),
        (lambda d: b"\x04\x22\x4d\x18" + d, "lz4"),
    ],
)
def test_compressed_input(compress: Callable[[bytes], bytes], name: str) -> None:
    message = str(_error(compress(SMALL)))
    assert "compressed" in message and name in message
    message = str(_error(compress(SMALL)[:20]))  # shorter than one block
    assert "compressed" in message and name in message


def test_negative_base256_size() -> None:
    archive = patch_header(SMALL, 0, slice(124, 136), b"\xff" * 12)
    assert "size" in str(_error(archive))


def test_huge_size() -> None:
    archive = patch_header(SMALL, 0, slice(124, 136), b"\x80" + (2**50).to_bytes(11, "big"))
    assert "size" in str(_error(archive))


def test_bad_octal_size() -> None:
    archive = patch_header(SMALL, 0, slice(124, 136), b"0000000009\0")
    assert "numeric" in str(_error(archive))


def _pax_archive(pax: dict[str, str]) -> bytes:
    info = tarfile.TarInfo("innocent")
    info.size = 1
    info.pax_headers = pax
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(b"x"))
        tf.addfile(tarfile.TarInfo("next"), io.BytesIO(b""))
    return buf.getvalue()


@pytest.mark.parametrize("path", ["../x", "/../x", "a/../../b"])
def test_pax_malicious_path(path: str) -> None:
    result = scan(_pax_archive({"path": path}))
    assert [m.path for m in result.members] == [b"next"]
    assert result.skipped == Counter({"unsafe-name": 1})


@pytest.mark.parametrize(("path", "want"), [("/etc/passwd", b"etc/passwd"), ("//a/./b", b"a/b"),
                                            ("a\0b", b"a")])
def test_pax_path_fixed_up_like_gnu_tar(path: str, want: bytes) -> None:
    """A leading '/' goes (counted in notes); a path ends at its first NUL."""
    scanner = TarScanner()
    members = scanner.feed(_pax_archive({"path": path}))
    assert [m.path for m in members] == [want, b"next"]
    assert scanner.skipped == Counter()
    assert scanner.notes == Counter({"leading-slash-removed": 1} if path[0] == "/" else {})


@pytest.mark.parametrize("size", ["-5", "1e3", "0x10", "99999999999999999999999", str(2**49)])
def test_pax_malicious_size(size: str) -> None:
    error = _error(_pax_archive({"size": size}))
    assert "pax size" in str(error)
    assert error.offset == 0  # the pax header's own offset, not the member's after it


def test_pax_size_with_leading_zeros() -> None:
    archive = _pax_archive({"size": "0" * 23 + "1"})
    assert [(m.path, m.size) for m in scan(archive).members] == [(b"innocent", 1), (b"next", 0)]


@pytest.mark.parametrize("mtime", ["abc", "1.2.3", "9" * 5000, "1748089464.951928467a"])
def test_pax_bad_mtime_is_ignored(mtime: str) -> None:
    """GNU tar keeps the header's mtime when the pax one does not parse; no byte depends
    on it, so the member is served (as GNU tar extracts it)."""
    scanner = TarScanner()
    members = scanner.feed(_pax_archive({"mtime": mtime}))
    assert [m.path for m in members] == [b"innocent", b"next"]
    assert members[0].mtime == members[1].mtime
    assert scanner.notes == Counter({"bad-pax-mtime-ignored": 1})


@pytest.mark.parametrize(("mtime", "want"), [("-1.5", -2), ("1e30", None), ("9" * 30, 2**33),
                                             ("-" + "9" * 30, -(2**33)), ("12.", 12)])
def test_pax_odd_mtimes(mtime: str, want: int | None) -> None:
    members = scan(_pax_archive({"mtime": mtime})).members
    assert members[0].mtime == (members[1].mtime if want is None else want)


def test_names_end_at_their_first_nul() -> None:
    # Bytes after a name's NUL terminator are leftovers some writers keep: never part of it,
    # in a header field or in a GNU long name.
    assert [m.path for m in scan(patch_header(SMALL, 0, slice(0, 100), b"a\0junk\0"))
            .members] == [b"a", b"b"]
    name = b"d/" + b"n" * 150
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", name, b"x")])
    at = archive.index(name + b"\0")  # the ././@LongLink data
    archive = archive[:at] + name[:-4] + b"\0zzz" + archive[at + len(name) :]
    assert [m.path for m in scan(archive).members] == [name[:-4]]


def test_pax_bad_records() -> None:
    archive = _pax_archive({"comment": "hello"})
    start = archive.index(b"17 comment=hello\n")
    for bad in [b"99 comment=hello\n", b"17 comment hello\n", b"17_comment=hello\n", b"x" * 17]:
        corrupt = archive[:start] + bad + archive[start + 17 :]
        assert "pax header" in str(_error(corrupt))


def test_oversized_gnu_long_name() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"n" * (1 << 20) + b"x", b"")])
    assert "too large" in str(_error(archive, 1 << 16))


def test_oversized_pax_header() -> None:
    assert "too large" in str(_error(_pax_archive({"comment": "c" * (16 << 20)})))
    large = _pax_archive({"comment": "c" * (8 << 20)})  # libarchive's pax_large_attr: 8 MB
    assert [m.path for m in scan(large, 1 << 16).members] == [b"innocent", b"next"]


def test_last_of_consecutive_pax_headers_wins() -> None:
    """GNU tar (unlike tarfile) forgets an 'x' header when another one follows."""
    archive = (raw_member(b"x1", tarfile.XHDTYPE, b"14 path=first\n")
               + raw_member(b"x2", tarfile.XHDTYPE, b"11 mtime=5\n")
               + raw_member(b"name", tarfile.REGTYPE, b"1") + bytes(1024))
    assert [(m.path, m.mtime) for m in scan(archive).members] == [(b"name", 5)]


def test_extended_header_without_member() -> None:
    """GNU tar ignores extended headers that no member follows; so do we (and count them)."""
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"n" * 200, b"")])
    for cut in (archive[:1024], archive[:1024] + bytes(1024)):  # L header and its name only
        result = scan(cut)
        assert result.members == []
        assert result.skipped == Counter({"extended-header-without-member": 1})


def test_error_is_sticky() -> None:
    scanner = TarScanner()
    with pytest.raises(TarError):
        scanner.feed(b"x" * 512)
    with pytest.raises(TarError):
        scanner.feed(SMALL)
    with pytest.raises(TarError):
        scanner.finish()


def raw_member(name: bytes, typeflag: bytes, data: bytes = b"", mtime: int = 7) -> bytes:
    """One header (+ data) written by tarfile, for member types tarfile does not produce."""
    info = tarfile.TarInfo(os.fsdecode(name))
    info.type = typeflag
    info.size = len(data)
    info.mtime = mtime
    return info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % BLOCK)


def test_lenient_octal_fields() -> None:
    archive = make_tar(tarfile.USTAR_FORMAT, [Entry("f", b"a", b"x"), Entry("f", b"b", b"y")])
    archive = patch_header(archive, 0, slice(136, 148), b"  1234\0junk")  # NUL, then garbage
    archive = patch_header(archive, 0, slice(100, 108), b" 755 ")
    archive = patch_header(archive, 1024, slice(136, 148), b" " * 12)  # blank: 0
    members = scan(archive).members
    assert [(m.mtime, m.mode) for m in members] == [(0o1234, 0o755), (0, 0o644)]
    archive = patch_header(archive, 0, slice(136, 148), b"12 34")
    assert "numeric" in str(_error(archive))


def test_empty_and_global_extended_headers() -> None:
    archive = (
        raw_member(b"empty-pax", tarfile.XHDTYPE)
        + raw_member(b"a", tarfile.REGTYPE, b"1")
        + raw_member(b"g", tarfile.XGLTYPE, b"11 mtime=5\n")
        + raw_member(b"b", tarfile.REGTYPE, b"2")
        + raw_member(b"g", tarfile.XGLTYPE, b"9 mtime=\n")  # an empty value unsets it
        + raw_member(b"c", tarfile.REGTYPE, b"3")
        + bytes(1024)
    )
    members = scan(archive, 100).members
    assert [(m.path, m.mtime, data_of(archive, m)) for m in members] == [
        (b"a", 7, b"1"),
        (b"b", 5, b"2"),
        (b"c", 7, b"3"),
    ]


def test_adversarial_extended_headers_stay_linear() -> None:
    # Near-limit pax headers: a path of 400k "./" components, and a global header of 30k
    # records that every later member would merge in if all of them were kept.
    records = b"".join(b"%d k%05d=v\n" % (len(b"k00000=v\n") + 3, i) for i in range(30_000))
    archive = (
        raw_member(b"pax", tarfile.XHDTYPE, _pax_record(b"path", b"./" * 400_000 + b"a"))
        + raw_member(b"x", tarfile.REGTYPE, b"1")
        + raw_member(b"g", tarfile.XGLTYPE, records)
        + b"".join(raw_member(b"m%d" % i, tarfile.REGTYPE, b"") for i in range(5000))
    )
    members = scan(archive).members
    assert [m.path for m in members[:2]] == [b"a", b"m0"] and len(members) == 5001


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))
    return b"%d" % length + body


def test_truncated_extended_header() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"n" * 200, b"")])
    assert "truncated extended header" in str(_error(archive[:600]))


def test_old_gnu_sparse_map_limits() -> None:
    header = bytearray(raw_member(b"s", b"S", b""))
    header[482] = 1  # "the sparse map goes on in extension blocks"
    fix_checksum(header)
    more = bytearray(BLOCK)
    more[504] = 1
    assert "truncated sparse header" in str(_error(bytes(header) + bytes(more)))
    assert "sparse map too large" in str(_error(bytes(header) + bytes(more) * 2100))
    done = bytes(header) + bytes(more) + bytes(BLOCK) + raw_member(b"next", tarfile.REGTYPE, b"1")
    result = scan(done)
    assert [(m.path, m.size, m.sparse) for m in result.members] == [(b"s", 0, None),
                                                                      (b"next", 1, None)]
    assert result.skipped == Counter()


def test_other_types_are_skipped_with_their_data() -> None:
    archive = (
        raw_member(b"vol", b"V")
        + raw_member(b"multi", b"M", b"continued" * 100)
        + raw_member(b"ctl", b"\x01", b"x")
        + raw_member(b"dumpdir", b"D", b"Ya\0\0")
        + raw_member(b"z", tarfile.REGTYPE, b"z")
    )
    result = scan(archive)
    assert [(m.path, m.kind) for m in result.members] == [(b"dumpdir", "d"), (b"z", "f")]
    assert data_of(archive, result.members[1]) == b"z"
    assert result.skipped == Counter(
        {"volume-label": 1, "multivolume": 1, "unsupported-type-0x01": 1}
    )


def test_feed_accepts_any_buffer() -> None:
    archive = make_tar(tarfile.GNU_FORMAT, [Entry("f", b"a", b"x")])
    scanner = TarScanner()
    members = scanner.feed(memoryview(bytearray(archive)).cast("I"))
    scanner.finish()
    assert [m.path for m in members] == [b"a"]


# -- property tests -------------------------------------------------------------------------


def _examples(ci: int) -> int:
    """Examples per fuzzing property: `ci` by default; a long fuzz run sets
    SHARDFS_FUZZ_EXAMPLES (e.g. 200000; see docs/reliability.md)."""
    return int(os.environ.get("SHARDFS_FUZZ_EXAMPLES") or ci)


def _check_invariants(data: bytes, chunk: int, use_skip: bool) -> None:
    try:
        result = scan(data, chunk, use_skip)
    except TarError:
        return
    for m in result.members:
        assert normalize_path(m.path) == m.path
        assert not m.path.startswith(b"/") and b".." not in m.path.split(b"/")
        assert m.offset >= 0 and m.size >= 0
        assert m.offset + m.size <= len(data)
        assert max(map(len, m.path.split(b"/"))) <= 255  # NAME_MAX
        if m.kind == "l":
            assert not m.linkname.startswith(b"/")
            assert _inside(m.path, m.linkname)  # not even through other symlinks


@settings(max_examples=_examples(300), deadline=None)
@given(st.binary(max_size=3000), st.integers(1, 1100), st.booleans())
def test_random_bytes_only_raise_tar_error(data: bytes, chunk: int, use_skip: bool) -> None:
    # Random bytes are (almost) never a tar: this checks only that garbage is rejected with a
    # TarError, never a crash. The member invariants are exercised by the next test.
    _check_invariants(data, chunk, use_skip)


# Valid archives with every kind of entry the scanner treats specially: long names (GNU and
# pax records), nested directories, symlinks inside and escaping, hard links, devices.
_MUTATION_BASES = [
    make_tar(fmt, [
        Entry("d", b"d"),
        Entry("f", b"d/" + b"n" * 120 + b".bin", b"x" * 700),
        Entry("f", b"d/e/f.txt", b"hello"),
        Entry("l", b"d/in", target=b"e/f.txt"),
        Entry("l", b"d/out", target=b"../../etc/passwd"),
        Entry("l", b"d/e/up", target=b"../x"),
        Entry("h", b"d/hard", target=b"d/e/f.txt"),
        Entry("c", b"dev"),
        Entry("f", b"../evil", b"e"),  # unsafe names, skipped unless the checks break
        Entry("f", b"/abs", b"a"),
        Entry("f", b"d/" + b"L" * 300, b"l"),
        Entry("f", b"z", b"z" * 1500),
    ])
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)
] + [make_tar(tarfile.USTAR_FORMAT, [Entry("f", b"a/" * 60 + b"u", b"1" * 600),
                                     Entry("l", b"a/l", target=b"../a/u"),
                                     Entry("f", b"b", b"2")])]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One to three damages: flipped bytes (in headers, so they reach the field parsers),
    a cut, a header spliced in from another archive, a block dropped or repeated."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        what = rng.randrange(5)
        headers = _header_offsets(bytes(out)) if what == 0 else []
        if headers:  # overwrite header bytes, then (usually) fix the checksum
            off = rng.choice(headers)
            for _ in range(rng.randint(1, 4)):
                out[off + rng.randrange(BLOCK)] = rng.choice([0, 0x2E, 0x2F, 0x30, 0x37,
                                                              rng.randrange(256)])
            if rng.random() < 0.8:
                block = out[off : off + BLOCK]
                fix_checksum(block)
                out[off : off + BLOCK] = block
        elif what == 1:  # any byte
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif what == 2:  # truncate
            del out[rng.randrange(len(out) + 1):]
        elif what == 3:  # splice a header block from another archive at a block boundary
            donor = rng.choice(_MUTATION_BASES)
            src = rng.choice(_header_offsets(donor))
            dst = BLOCK * rng.randrange(max(1, len(out) // BLOCK))
            out[dst:dst] = donor[src : src + BLOCK]
        elif len(out) >= BLOCK:  # drop or repeat one block
            at = BLOCK * rng.randrange(len(out) // BLOCK)
            if rng.random() < 0.5:
                del out[at : at + BLOCK]
            else:
                out[at:at] = out[at : at + BLOCK]
        if not out:
            break
    return bytes(out)


def test_mutated_valid_archives_keep_the_member_invariants() -> None:
    """Damaged real archives: whatever still scans must expose only safe members that lie
    inside the data, and a good share must still scan (else the checks never ran)."""
    rng = random.Random(1600)
    runs = _examples(1500)
    scanned = rejected = members = 0
    for _ in range(runs):
        data = _mutate(rng, rng.choice(_MUTATION_BASES))
        chunk, use_skip = rng.choice([7, 512, 513, 4096, 1 << 20]), rng.random() < 0.5
        try:
            result = scan(data, chunk, use_skip)
        except TarError:
            rejected += 1
            continue
        scanned += 1
        members += len(result.members)
        _check_invariants(data, chunk, use_skip)
    # Both outcomes are common, so both paths were exercised.
    assert scanned >= runs // 5 and rejected >= runs // 10, (scanned, rejected)
    assert members >= runs, members


_name = st.lists(
    st.sampled_from([b"a", b"b", b".", b"..", b"", b"\xff", "é".encode(), b"x" * 60,
                     b"y" * 256]),
    min_size=1,
    max_size=5,
).map(b"/".join)
_entry = st.builds(
    Entry,
    kind=st.sampled_from("ffffdlhcpZ7"),
    name=_name,
    content=st.binary(max_size=1200),
    target=_name,
)


def _header_offsets(data: bytes) -> list[int]:
    """512-aligned blocks that carry a valid checksum: the headers, found independently."""
    out = []
    for off in range(0, len(data) - BLOCK + 1, BLOCK):
        block = data[off : off + BLOCK]
        if any(block):
            try:
                stored = int(block[148:156].rstrip(b"\0 "), 8)
            except ValueError:
                continue
            if stored in tarfile.calc_chksums(block):
                out.append(off)
    return out


@settings(max_examples=_examples(400), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(list(FORMATS.values())),
    entries=st.lists(_entry, max_size=6),
    mutations=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    fix=st.booleans(),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    chunk=st.integers(1, 2000),
    use_skip=st.booleans(),
)
def test_mutated_archives(
    fmt: int,
    entries: list[Entry],
    mutations: list[tuple[int, int]],
    fix: bool,
    cut: int | None,
    chunk: int,
    use_skip: bool,
) -> None:
    try:
        archive = make_tar(fmt, entries)
    except ValueError:
        return  # tarfile cannot write this (ustar name too long): nothing to test
    if not mutations and cut is None:
        # Unmutated: must scan, and agree with the model of what is exposed.
        result = scan(archive, chunk, use_skip)
        want, skipped = expected(entries)
        check(archive, result, want)
        assert result.skipped == skipped
        return
    data = bytearray(archive)
    headers = _header_offsets(archive)
    for pos, value in mutations:
        data[pos % len(data)] = value
    if fix:  # recompute checksums so the damage reaches the field parsers
        for off in headers:
            block = data[off : off + BLOCK]
            fix_checksum(block)
            data[off : off + BLOCK] = block
    if cut is not None:
        del data[cut % (len(data) + 1) :]
    _check_invariants(bytes(data), chunk, use_skip)


# -- speed (reported, not asserted) ---------------------------------------------------------


def test_speed_report(capsys: pytest.CaptureFixture[str]) -> None:
    count = 20_000
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(count):
            info = tarfile.TarInfo(f"shard/sample{i:07d}.cls")
            info.size = 3
            tf.addfile(info, io.BytesIO(b"123"))
    archive = memoryview(buf.getvalue())
    start = time.process_time()  # CPU time: less noisy on a shared machine
    scanner = TarScanner()
    n = 0
    for pos in range(0, len(archive), 1 << 20):
        n += len(scanner.feed(archive[pos : pos + (1 << 20)]))
    scanner.finish()
    elapsed = time.process_time() - start
    assert n == count
    with capsys.disabled():
        print(f"\ntar scan: {count / elapsed:,.0f} headers/s")
