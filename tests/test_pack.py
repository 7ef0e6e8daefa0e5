"""shardfs pack: round trip through tarfile (and webdataset if installed), sample grouping,
shard sizing, recorded offsets/hashes, determinism, shuffle, overwrite protection, errors, CLI."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from shardfs.catalog.shardindex import decode_index
from shardfs.devtools.datagen import make_imagefolder
from shardfs.pack import (
    FIXED_MTIME,
    PackError,
    PackResult,
    configure_pack_parser,
    index_path,
    pack,
    run_pack,
    split_key,
)

SHARD_SIZE = 96 * 1024
LONG_DIR = "extra/" + "/".join(["d" * 40] * 3)  # > 100 bytes once a file name is added
LONG_NAME = f"{LONG_DIR}/{'f' * 120}.long.bin"  # > 255 bytes: fits no ustar name+prefix split
UNICODE_NAME = "extra/ünïcödé/ひらがな.txt"
BIG_NAME = "extra/big.bin"  # bigger than SHARD_SIZE on its own


def _write(root: Path, name: str, data: bytes) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    make_imagefolder(root, classes=3, per_class=8, mean_kb=6, seed=2)
    extras = {
        "extra/seg/x.jpg": b"x-jpg",
        "extra/seg/x.seg.png": b"x-seg-png" * 100,
        "extra/seg/x.json": b'{"label": 1}',
        "extra/seg/y.jpg": b"y-jpg",
        "extra/seg/y.seg.png": b"y-seg-png",
        # 'a/x.d/y.jpg' sorts between 'a/x.a' and 'a/x.z' but is another sample.
        "extra/a/x.a": b"xa",
        "extra/a/x.d/y.jpg": b"y",
        "extra/a/x.z": b"xz",
        "extra/empty.txt": b"",
        "extra/README": b"no extension",
        UNICODE_NAME: "unicode ✓".encode(),
        LONG_NAME: b"long" * 300,
        BIG_NAME: os.urandom(3 * SHARD_SIZE),
    }
    for name, data in extras.items():
        _write(root, name, data)
    os.symlink("x.jpg", root / "extra/seg/link.jpg")  # symlinks are skipped, not followed
    os.symlink("seg", root / "extra/seglink")
    return root


def _source_files(root: Path) -> dict[str, bytes]:
    files = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def _read_shard(path: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(path) as tar:
        out = []
        for info in tar:
            f = tar.extractfile(info)
            assert f is not None, f"{info.name} is not a regular file"
            out.append((info, f.read()))
        return out


def _names(result: PackResult) -> list[str]:
    return [m[0] for shard in result.shards for m in shard.members]


@pytest.fixture(scope="module")
def packed(src: Path, tmp_path_factory: pytest.TempPathFactory) -> PackResult:
    return pack(src, tmp_path_factory.mktemp("out") / "shards", shard_size=SHARD_SIZE)


def test_split_key() -> None:
    assert split_key("a/b/x.seg.png") == ("a/b/x", "seg.png")
    assert split_key("x.jpg") == ("x", "jpg")
    assert split_key("a/x.d/y.jpg") == ("a/x.d/y", "jpg")
    assert split_key("a/README") == ("a/README", "")


def test_round_trip_is_byte_exact(src: Path, packed: PackResult) -> None:
    expected = _source_files(src)
    got: dict[str, bytes] = {}
    for shard in packed.shards:
        for info, data in _read_shard(shard.path):
            assert info.isreg()  # files only: no directory members
            assert info.name not in got
            got[info.name] = data
            assert (info.mode, info.uid, info.gid, info.uname, info.gname) == (
                0o644, 0, 0, "", "")
            assert info.mtime == FIXED_MTIME
    assert got == expected
    assert {LONG_NAME, UNICODE_NAME, "extra/empty.txt"} <= got.keys()
    assert packed.skipped == ["extra/seg/link.jpg", "extra/seglink"]


def test_samples_are_consecutive_and_never_split(packed: PackResult) -> None:
    seen: set[str] = set()
    for shard in packed.shards:
        keys = [split_key(name)[0] for name in (m[0] for m in shard.members)]
        runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
        assert len(runs) == len(set(runs)), "a sample's files are not consecutive"
        assert not seen & set(runs), "a sample is split across shards"
        seen |= set(runs)
        assert shard.nsamples == len(runs)
    assert {"extra/seg/x", "extra/a/x", "extra/a/x.d/y"} <= seen
    names = _names(packed)
    i = names.index("extra/seg/x.jpg")
    assert sorted(names[i:i + 3]) == ["extra/seg/x.jpg", "extra/seg/x.json", "extra/seg/x.seg.png"]


def test_shard_sizes_and_names(packed: PackResult) -> None:
    assert len(packed.shards) > 3
    for i, shard in enumerate(packed.shards):
        assert shard.path.name == f"shard-{i:06d}.tar"
        assert shard.size == shard.path.stat().st_size
        assert shard.size % tarfile.RECORDSIZE == 0
        names = [m[0] for m in shard.members]
        if shard.size > SHARD_SIZE:  # only a lone oversize sample may exceed the limit
            assert shard.nsamples == 1 and names == [BIG_NAME]
    out = packed.shards[0].path.parent
    names = [s.path.name for s in packed.shards]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        names + [n + ".shardfs.idx" for n in names])
    for shard in packed.shards:  # each index file describes its shard exactly
        index = decode_index(index_path(shard.path).read_bytes(), expect_size=shard.size)
        assert index.sha256 == shard.sha256
        assert [p.decode() for p in index.paths] == [m[0] for m in shard.members]
        assert list(index.offsets) == [m[1] for m in shard.members]
        assert list(index.sizes) == [m[2] for m in shard.members]
    n = len(packed.shards)
    assert packed.pattern == str(out / f"shard-{{000000..{n - 1:06d}}}.tar")


def test_recorded_offsets_sizes_and_hashes(src: Path, packed: PackResult) -> None:
    for shard in packed.shards:
        blob = shard.path.read_bytes()
        assert hashlib.sha256(blob).hexdigest() == shard.sha256
        infos = [info for info, _ in _read_shard(shard.path)]
        assert [(i.name, i.offset_data, i.size, i.mtime) for i in infos] == shard.members
        for name, offset, size, _ in shard.members:
            assert blob[offset:offset + size] == (src / name).read_bytes()


def test_pax_header_only_when_needed(packed: PackResult) -> None:
    for shard in packed.shards:
        for info, _ in _read_shard(shard.path):
            needs_pax = len(info.name.encode()) > 100 or not info.name.isascii()
            assert bool(info.pax_headers) == needs_pax, info.name


def test_deterministic_bytes(src: Path, packed: PackResult, tmp_path: Path) -> None:
    again = pack(src, tmp_path / "again", shard_size=SHARD_SIZE)
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in packed.shards]
    for a, b in zip(again.shards, packed.shards, strict=True):
        assert a.path.read_bytes() == b.path.read_bytes()


def test_shuffle_changes_order_not_content(src: Path, packed: PackResult, tmp_path: Path) -> None:
    s1 = pack(src, tmp_path / "s1", shard_size=SHARD_SIZE, shuffle=True, seed=1)
    s1b = pack(src, tmp_path / "s1b", shard_size=SHARD_SIZE, shuffle=True, seed=1)
    s2 = pack(src, tmp_path / "s2", shard_size=SHARD_SIZE, shuffle=True, seed=2)
    assert _names(s1) != _names(packed) and _names(s1) != _names(s2)
    assert sorted(_names(s1)) == sorted(_names(packed)) == sorted(_names(s2))
    assert [s.sha256 for s in s1.shards] == [s.sha256 for s in s1b.shards]
    contents = {}
    for shard in s1.shards:
        contents.update({info.name: data for info, data in _read_shard(shard.path)})
    assert contents == _source_files(src)


def test_samples_per_shard(src: Path, tmp_path: Path) -> None:
    result = pack(src, tmp_path / "o", shard_size=2**30, samples_per_shard=5)
    counts = [s.nsamples for s in result.shards]
    assert all(c == 5 for c in counts[:-1]) and 1 <= counts[-1] <= 5
    assert result.nfiles == len(_source_files(src))


def test_single_shard_pattern_and_keep_mtime(src: Path, tmp_path: Path) -> None:
    result = pack(src, tmp_path / "one", prefix="all", keep_mtime=True)
    assert len(result.shards) == 1
    assert result.pattern == str(tmp_path / "one" / "all-000000.tar")
    name, _, _, mtime = result.shards[0].members[0]
    assert mtime == int((src / name).stat().st_mtime)


def test_refuses_to_overwrite_unless_forced(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = pack(src, out, shard_size=SHARD_SIZE)
    (out / "other-000000.tar").write_bytes(b"keep me")
    with pytest.raises(PackError, match=r"shard-000000\.tar.*force"):
        pack(src, out, shard_size=SHARD_SIZE)
    assert first.shards[0].path.read_bytes()  # untouched
    pack(src, out, prefix="fresh")  # another prefix does not conflict
    forced = pack(src, out, shard_size=2**30, force=True)
    assert len(forced.shards) == 1 < len(first.shards)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".tar") == [
        "fresh-000000.tar", "other-000000.tar", "shard-000000.tar"]
    # --force also removed the replaced shards' index files
    assert sorted(p.name for p in out.glob("shard-*.idx")) == ["shard-000000.tar.shardfs.idx"]


def _pack_with_hook(src: Path, out: Path, hook: Callable[[], None]) -> None:
    """Run hook() when pack reports progress (0, total): after the walk, before any reading."""

    def progress(done: int, total: int) -> None:
        if done == 0:
            hook()

    pack(src, out, shard_size=SHARD_SIZE, progress=progress)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p.unlink(), "cannot read .*victim.bin: No such file"),
        (lambda p: p.write_bytes(b"short"), "victim.bin shrank while packing"),
        (lambda p: p.write_bytes(b"x" * 9000), "victim.bin grew while packing"),
        (lambda p: (p.unlink(), os.mkfifo(p)), "victim.bin: no longer a regular file"),
    ],
    ids=["vanished", "shrank", "grew", "fifo"],
)
def test_file_changing_during_pack_is_a_clear_error(
        tmp_path: Path, change: Callable[[Path], object], message: str) -> None:
    src = tmp_path / "src"
    for i in range(30):
        _write(src, f"d/f{i:02d}.bin", bytes(4000))
    victim = src / "d/victim.bin"
    victim.write_bytes(bytes(4000))
    out = tmp_path / "out"
    with pytest.raises(PackError, match=message):
        _pack_with_hook(src, out, lambda: change(victim))
    assert list(out.iterdir()) == []  # finished shards and the temp file are cleaned up


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read files without permission")
def test_unreadable_file(tmp_path: Path) -> None:
    _write(tmp_path / "src", "a.bin", b"secret")
    (tmp_path / "src" / "a.bin").chmod(0)
    with pytest.raises(PackError, match=r"cannot read .*a\.bin: Permission denied"):
        pack(tmp_path / "src", tmp_path / "out")


def test_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(PackError, match="no regular files"):
        pack(tmp_path / "src", tmp_path / "out")
    with pytest.raises(PackError, match="not a directory"):
        pack(tmp_path / "missing", tmp_path / "out")
    _write(tmp_path / "src", "a.txt", b"a")
    with pytest.raises(PackError, match="inside the source"):
        pack(tmp_path / "src", tmp_path / "src" / "shards")
    with pytest.raises(PackError, match="prefix"):
        pack(tmp_path / "src", tmp_path / "out", prefix="a/b")
    with pytest.raises(PackError, match="shard size"):
        pack(tmp_path / "src", tmp_path / "out", shard_size=0)


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardfs pack")
    configure_pack_parser(parser)
    return run_pack(parser.parse_args(argv))


def test_run_pack_prints_pattern(src: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert _cli([str(src), str(out), "--shard-size", "96KiB", "--shuffle", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1
    match = re.fullmatch(re.escape(str(out)) + r"/shard-\{000000\.\.(\d{6})\}\.tar", lines[0])
    assert match is not None
    assert len(list(out.glob("shard-*.tar"))) == int(match.group(1)) + 1
    assert "100%" in captured.err  # stderr is not a tty here: ~10% log lines
    assert re.search(r"\d+ shards, \d+ samples \(\d+ files\)", captured.err)
    assert "skipped 2 entries" in captured.err

    assert _cli([str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardfs pack: error: refusing to overwrite")
    assert _cli([str(tmp_path / "nope"), str(out)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_rejects_bad_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        _cli([str(tmp_path), str(tmp_path / "o"), "--shard-size", "12X"])
    assert excinfo.value.code == 2
    assert "unknown unit 'X'" in capsys.readouterr().err


def test_webdataset_reads_the_shards(src: Path, packed: PackResult) -> None:
    wds = pytest.importorskip("webdataset")
    expected: dict[str, dict[str, bytes]] = {}
    for name, data in _source_files(src).items():
        key, ext = split_key(name)
        if ext and split_key(name)[0].rpartition("/")[2]:  # webdataset ignores extensionless
            expected.setdefault(key, {})[ext.lower()] = data
    got: dict[str, dict[str, bytes]] = {}
    urls = [str(s.path) for s in packed.shards]
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        key = sample["__key__"]
        assert key not in got, f"sample {key} split or repeated"
        got[key] = {k: v for k, v in sample.items() if not k.startswith("__")}
    assert got == expected
    # Also through the brace pattern, as a training script would pass it.
    assert sum(1 for _ in wds.WebDataset(packed.pattern, shardshuffle=False)) == len(expected)


def test_progress_line_redraws_on_a_tty() -> None:
    from io import StringIO

    from shardfs.util.progress import ProgressLine

    class Tty(StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    line = ProgressLine("shardfs pack", stream, unit="files")
    for done in range(0, 1001, 10):
        line(done, 1000)
    line.close()
    text = stream.getvalue()
    assert text.startswith("\rshardfs pack: 0/1000 files (0%)")
    assert text.endswith("\rshardfs pack: 1000/1000 files (100%)\n")
    assert text.count("\n") == 1


def test_progress_line_logs_every_tenth_when_not_a_tty() -> None:
    from io import StringIO

    from shardfs.util.progress import ProgressLine

    stream = StringIO()
    line = ProgressLine("indexing shards", stream)
    for done in range(0, 1001):
        line(done, 1000)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # 0 %, 10 %, ..., 100 %
    assert lines[-1] == "indexing shards: 1000/1000 (100%)"
