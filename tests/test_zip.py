"""Zip shards without a mount: the index built by ranged reads (catalog/zip.py through
catalog/archives.py on a file:// source), its published form, and member bytes decoded as the
mount decodes them (read/packed.py), against Python's zipfile and the tools' own trees."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path

import pytest

from shardfs.catalog import zip as zipfmt
from shardfs.catalog.shardindex import INDEX_FORMAT, encode_index
from shardfs.read.packed import DecodeError, decode
from tests.zipkit import (
    central_entries,
    index_file,
    patch,
    python_extraction,
    read_members,
    sample_files,
    set_central,
    write_streamed_zip,
    write_zip,
    write_zip64_sparse,
)

# Debian's 7zip package installs 7zz; p7zip-full installs 7z.
SEVEN_ZIP = shutil.which("7zz") or shutil.which("7z")


def test_python_zipfile_every_method(tmp_path: Path):
    files = sample_files()
    path = write_zip(tmp_path / "a.zip", files)
    index = index_file(path)
    assert read_members(path, index) == python_extraction(path) == files
    codecs = {index.packed[p][0] for p in index.packed}
    assert codecs == {"deflate", "bzip2", "lzma"}
    assert len(index.packed) == 30  # every fourth member is stored: a plain byte range


def test_all_stored_zip_writes_the_plain_index_format(tmp_path: Path):
    files = sample_files(1, 10)
    path = write_zip(tmp_path / "s.zip", files, methods=(zipfile.ZIP_STORED,))
    index = index_file(path)
    assert not index.packed
    assert encode_index(index).startswith(b'{"body_sha256"')
    assert f'"format": "{INDEX_FORMAT}"'.encode() in encode_index(index).split(b"\n")[0]
    assert read_members(path, index) == files


def test_data_descriptors_from_a_non_seekable_writer(tmp_path: Path):
    files = sample_files(2, 12)
    path = write_streamed_zip(tmp_path / "dd.zip", files)
    # Every local header says "sizes in a data descriptor" (flag bit 3) with zero sizes.
    with zipfile.ZipFile(path) as z:
        assert all(i.flag_bits & 0x8 for i in z.infolist())
    index = index_file(path)
    assert read_members(path, index) == files


def test_comment_prepended_stub_and_fake_end_record_in_comment(tmp_path: Path):
    files = sample_files(3, 8)
    plain = write_zip(tmp_path / "p.zip", files)
    with zipfile.ZipFile(plain, "a") as z:
        z.comment = b"comment PK\x05\x06 with a fake end record inside" + bytes(40)
    # A self-extractor: bytes before the zip shift every offset.
    sfx = tmp_path / "sfx.zip"
    sfx.write_bytes(b"#!/bin/sh\nexit 0\n" + b"\0" * 1000 + plain.read_bytes())
    for path in (plain, sfx):
        index = index_file(path)
        assert read_members(path, index) == files


def test_names_decoded_as_unzip_does_on_linux(tmp_path: Path):
    path = tmp_path / "names.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("flagged-\u00e9t\u00e9.txt", b"utf8 flagged")  # zipfile sets the UTF-8 flag
        z.writestr("cp437-caf?.txt", b"cp437")
        z.writestr("unflagged-XX.txt", b"utf8 unflagged")
        info = zipfile.ZipInfo("dos\\sub\\file.txt")
        info.create_system = 0  # MS-DOS: backslashes are separators
        z.writestr(info, b"dos")
    patch(path, b"caf?", b"caf\x82")  # 0x82 is é in CP437, not valid UTF-8
    patch(path, b"unflagged-XX", b"unflagged-\xc3\xa9")  # UTF-8 without the flag (Info-ZIP)
    index = index_file(path)
    names = set(read_members(path, index))
    assert names == {"flagged-\u00e9t\u00e9.txt", "cp437-caf\u00e9.txt",
                     "unflagged-\u00e9.txt", "dos/sub/file.txt"}


def test_directories_and_unsafe_names(tmp_path: Path):
    path = tmp_path / "dirs.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.mkdir("empty")
        z.writestr("./", b"")
        z.writestr("ok/file.txt", b"ok")
        z.writestr("../evil.txt", b"evil")
        z.writestr("a/../../evil2.txt", b"evil")
        z.writestr("/abs/file.txt", b"abs")
    index = index_file(path)
    kinds = {p.decode(): chr(k) for p, k in zip(index.paths, index.kinds, strict=True)}
    assert kinds == {"empty": "d", "ok/file.txt": "f", "abs/file.txt": "f"}
    assert index.skipped == {"unsafe-name": 2, "root-dir": 1}
    assert index.notes == {"leading-slash-removed": 1}


def test_zip64_many_entries(tmp_path: Path):
    n = 70_000  # more than 65,535: ZIP64 end records
    path = tmp_path / "many.zip"
    with zipfile.ZipFile(path, "w") as z:
        for i in range(n):
            z.writestr(f"d{i % 100}/f{i}", b"%d" % i)
    assert b"PK\x06\x06" in path.read_bytes()[-200:]
    index = index_file(path)
    assert len(index) == n
    with open(path, "rb") as f:
        data = f.read()
    for pos in (0, 12345, n - 1):
        assert data[index.offsets[pos] : index.offsets[pos] + index.sizes[pos]] == \
            index.paths[pos].split(b"/f")[1]


def test_zip64_member_past_4gib_in_a_sparse_file(tmp_path: Path):
    big = (4 << 30) + 4096
    path = tmp_path / "z64.zip"
    crc, tail_at = write_zip64_sparse(path, big, b"the member past 4 GiB")
    assert path.stat().st_blocks * 512 < 1 << 20  # the hole takes no disk
    index = index_file(path)
    pos = {p: i for i, p in enumerate(index.paths)}
    assert index.sizes[pos[b"big.bin"]] == big
    assert index.offsets[pos[b"tail.bin"]] == tail_at > 1 << 32
    with zipfile.ZipFile(path) as z:  # Python agrees on the small member
        assert z.read("tail.bin") == b"the member past 4 GiB"
        assert z.getinfo("big.bin").file_size == big and crc == z.getinfo("big.bin").CRC
    with open(path, "rb") as f:
        f.seek(index.offsets[pos[b"tail.bin"]])
        assert f.read(index.sizes[pos[b"tail.bin"]]) == b"the member past 4 GiB"


@pytest.mark.parametrize("tool", ["zip", "bsdtar", "7z"])
def test_zips_written_by_other_tools(tmp_path: Path, tool: str):
    exe = {"zip": "zip", "bsdtar": "bsdtar", "7z": SEVEN_ZIP}[tool]
    if exe is None or shutil.which(exe) is None:
        pytest.skip(f"{tool} not installed (Debian: zip, libarchive-tools, 7zip)")
    src = tmp_path / "src"
    files = sample_files(4, 24)
    files["caf\u00e9/na\u00efve.txt"] = b"non-ASCII names"
    files["empty.txt"] = b""
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    (src / "emptydir").mkdir()
    out = tmp_path / "t.zip"
    cmd = {"zip": ["zip", "-qr", str(out), "."],
           "bsdtar": ["bsdtar", "--format", "zip", "-cf", str(out), "."],
           "7z": [exe, "a", "-tzip", "-bd", "-bso0", str(out), "."]}[tool]
    subprocess.run(cmd, cwd=src, check=True)
    index = index_file(out)
    assert read_members(out, index) == files
    assert b"emptydir" in index.paths


def test_7zip_deflate64_and_bzip2(tmp_path: Path):
    if SEVEN_ZIP is None:
        pytest.skip("7-Zip not installed (Debian: 7zip)")
    pytest.importorskip("inflate64")
    src = tmp_path / "src"
    src.mkdir()
    files = sample_files(5, 6)
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    for method, codec in (("Deflate64", "deflate64"), ("BZip2", "bzip2")):
        out = tmp_path / f"{codec}.zip"
        subprocess.run([SEVEN_ZIP, "a", "-tzip", f"-mm={method}", "-bd", "-bso0", str(out), "."],
                       cwd=src, check=True)
        index = index_file(out)
        assert {p[0] for p in index.packed.values()} == {codec}
        assert read_members(out, index) == files


def test_encrypted_members_are_skipped_and_counted(tmp_path: Path):
    if shutil.which("zip") is None:
        pytest.skip("zip not installed")
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.txt").write_bytes(b"secret" * 100)
    (src / "open.txt").write_bytes(b"open" * 100)
    out = tmp_path / "enc.zip"
    subprocess.run(["zip", "-q", "-P", "pw", str(out), "secret.txt"], cwd=src, check=True)
    subprocess.run(["zip", "-q", str(out), "open.txt"], cwd=src, check=True)
    index = index_file(out)
    assert index.skipped == {"encrypted": 1}
    assert read_members(out, index) == {"open.txt": b"open" * 100}


# -- hostile zips: a clear error or a skipped member, never a hang, a crash or bytes outside


def test_not_a_zip_and_truncated(tmp_path: Path):
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"hello" * 100)
    with pytest.raises(zipfmt.ZipError, match="not a zip"):
        index_file(bad)
    good = write_zip(tmp_path / "g.zip", sample_files(6, 5))
    cut = tmp_path / "cut.zip"
    cut.write_bytes(good.read_bytes()[:-30])
    with pytest.raises(zipfmt.ZipError):
        index_file(cut)


def test_central_directory_outside_the_file(tmp_path: Path):
    path = write_zip(tmp_path / "o.zip", sample_files(7, 5))
    data = bytearray(path.read_bytes())
    eocd = data.rfind(b"PK\x05\x06")
    for field, value in ((16, 1 << 31), (12, 1 << 31)):  # cd offset, then cd size
        broken = bytearray(data)
        struct.pack_into("<L", broken, eocd + field, value)
        path.write_bytes(broken)
        with pytest.raises(zipfmt.ZipError, match=r"outside|too large|cannot hold"):
            index_file(path)


def test_entries_pointing_outside_or_overlapping_are_skipped(tmp_path: Path):
    files = {f"f{i}": bytes([i]) * 1000 for i in range(6)}
    path = write_zip(tmp_path / "h.zip", files, methods=(zipfile.ZIP_STORED,))
    entries = central_entries(path)
    with zipfile.ZipFile(path) as z:
        second = z.infolist()[1].header_offset
    set_central(path, entries[0], "header", 1 << 30)  # local header past the end
    set_central(path, entries[2], "header", second)  # same local header as f1: overlaps it
    set_central(path, entries[3], "csize", 1 << 30)  # stored data far past the end (a bomb)
    set_central(path, entries[3], "usize", 1 << 30)
    index = index_file(path)
    members = read_members(path, index)
    assert members == {"f1": files["f1"], "f4": files["f4"], "f5": files["f5"]}
    assert index.skipped == {"bad-local-header": 1, "overlapping": 1, "data-outside-file": 1}


def test_zip_bomb_declared_sizes(tmp_path: Path):
    path = tmp_path / "bomb.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("zeros", bytes(10 << 20))  # 10 MiB of zeros: ~10 KB deflated
    set_central(path, central_entries(path)[0], "usize", 1000)  # declares far less
    index = index_file(path)
    with open(path, "rb") as f:
        f.seek(index.offsets[0])
        raw = f.read(index.stored_size(0))
    with pytest.raises(DecodeError, match="more"):
        decode(index.packed[0], raw, index.sizes[0])  # stops at 1001 bytes, never 10 MiB


def test_bad_crc_is_a_decode_error(tmp_path: Path):
    path = write_zip(tmp_path / "c.zip", {"a": b"hello world " * 100},
                     methods=(zipfile.ZIP_DEFLATED,))
    set_central(path, central_entries(path)[0], "crc", 12345)
    index = index_file(path)
    with open(path, "rb") as f:
        f.seek(index.offsets[0])
        raw = f.read(index.stored_size(0))
    with pytest.raises(DecodeError, match="CRC"):
        decode(index.packed[0], raw, index.sizes[0])
    assert zlib.crc32(b"hello world " * 100) != 12345


def test_published_index_rejects_bad_codec_fields(tmp_path: Path):
    from shardfs.catalog.shardindex import IndexFormatError, decode_index

    path = write_zip(tmp_path / "x.zip", {"a": b"abc" * 50}, methods=(zipfile.ZIP_DEFLATED,))
    data = encode_index(index_file(path))
    head, body = data.split(b"\n", 1)
    for bad in (body.replace(b"@deflate", b"@rot13"), body.replace(b"@deflate,", b"@deflate,-")):
        import hashlib
        import json

        header = json.loads(head)
        header["body_sha256"] = hashlib.sha256(bad).hexdigest()
        with pytest.raises(IndexFormatError):
            decode_index(json.dumps(header).encode() + b"\n" + bad)


def _index_bytes(data: bytes) -> list:
    """zip.py's steps on bytes in memory (what archives.index_zip does with ranged reads)."""
    tail_start = max(0, len(data) - zipfmt.TAIL)
    where = zipfmt.locate_directory(data[tail_start:], tail_start, len(data))
    if where.zip64_at is not None:
        where = zipfmt.zip64_directory(data[where.zip64_at : where.zip64_at + 56],
                                       where.zip64_at, len(data))
    entries = zipfmt.parse_directory(data[where.start : where.start + where.size], where)
    starts = [zipfmt.data_start(e, data[e.header : e.header + zipfmt.head_span(e)])
              for e in entries]
    return zipfmt.members(entries, starts, where).members


def test_mutated_zips_fail_cleanly_or_stay_inside_the_file(tmp_path: Path):
    import random

    path = write_zip(tmp_path / "m.zip", sample_files(9, 12))
    original = path.read_bytes()
    r = random.Random(0)
    outcomes = {"error": 0, "ok": 0}
    for _ in range(250):
        data = bytearray(original)
        # Mutations aimed at the directory and end records, where every offset and size lives.
        for _ in range(r.randint(1, 4)):
            at = r.randrange(len(data) - 300, len(data)) if r.random() < 0.8 else \
                r.randrange(len(data))
            data[at] = r.randrange(256)
        try:
            members = _index_bytes(bytes(data))
        except zipfmt.ZipError:
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        for m in members:
            stored = m.packed[1] if m.packed else m.size
            assert m.offset >= 0 and m.offset + stored <= len(data)
            if m.kind == "f" and m.size <= 1 << 20:
                raw = bytes(data[m.offset : m.offset + stored])
                try:
                    out = decode(m.packed, raw, m.size) if m.packed else raw
                except DecodeError:
                    continue
                assert len(out) == m.size
    assert outcomes["error"] and outcomes["ok"]


def test_pack_format_zip_is_reproducible_and_indexed_alike(tmp_path: Path):
    from shardfs.catalog.shardindex import decode_index
    from shardfs.pack import pack

    src = tmp_path / "src"
    files = sample_files(10, 30)
    files["non-ascii/\u00e9.jpg"] = b"\xff\xd8" * 10
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    one = pack(src, tmp_path / "one", shard_size=64 << 10, fmt="zip")
    two = pack(src, tmp_path / "two", shard_size=64 << 10, fmt="zip")
    assert len(one.shards) > 2 and one.pattern.endswith(".zip")
    got: dict[str, bytes] = {}
    for a, b in zip(one.shards, two.shards, strict=True):
        assert a.path.read_bytes() == b.path.read_bytes()
        published = decode_index(Path(str(a.path) + ".shardfs.idx").read_bytes())
        ranged = index_file(a.path)
        assert published.paths == ranged.paths and published.offsets == ranged.offsets
        assert python_extraction(a.path) == read_members(a.path, ranged)
        got.update(read_members(a.path, ranged))
        if shutil.which("unzip"):
            subprocess.run(["unzip", "-tq", str(a.path)], check=True, capture_output=True)
    assert got == files


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_stream_decoder_in_odd_pieces(tmp_path: Path, method: int):
    """read/packed.py's incremental decoder (large members) gives what the whole decode
    gives, fed in pieces of any size."""
    from shardfs.read.packed import _Incremental

    data = b"".join(bytes([i % 251]) * (i % 700) for i in range(3000))
    path = write_zip(tmp_path / "s.zip", {"m": data}, methods=(method,))
    index = index_file(path)
    with open(path, "rb") as f:
        f.seek(index.offsets[0])
        raw = f.read(index.stored_size(0))
    decoder = _Incremental(index.packed[0][0])
    out: list[bytes] = []
    for at in range(0, len(raw), 333):
        decoder.push(raw[at : at + 333], out.append)
    assert b"".join(out) == data == decode(index.packed[0], raw, len(data))
