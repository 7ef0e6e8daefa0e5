"""A corpus of crafted, hostile and malformed tar shards, with what shardfs must make of each.

`build_corpus(directory)` writes every shard and returns one `Case` per shard:

- `error`: the shard is unusable; mounting it must fail with a non-zero exit and one
  `shardfs: error:` line naming the shard and containing this text. Nothing is mounted.
- otherwise the mount must succeed and expose exactly `files` (path -> bytes) and `links`
  (path -> target), count `skipped` (reason -> members) in the tree-build log line, and
  nothing may resolve outside the mount.

Headers are assembled by hand (not with tarfile), so that fields can lie: checksums, sizes,
offsets past EOF, base-256 numbers, pax records, GNU long names, type flags.

    python -m tests.hostile_corpus OUT_DIR      # write the corpus, e.g. to try other tools
"""

from __future__ import annotations

import gzip
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 512
MiB = 1 << 20


@dataclass
class Case:
    name: str  # the shard's file name, also the test id
    data: bytes
    why: str  # what is hostile about it
    error: str | None = None  # unusable: the mount fails with this in its message
    files: dict[bytes, bytes] = field(default_factory=dict)
    links: dict[bytes, bytes] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    dirs_at_least: int = 0  # directories the tree must hold (deep paths)


# -- raw tar building ------------------------------------------------------------------------


def _pad(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def header(name: bytes, *, size: int = 0, typeflag: bytes = b"0", linkname: bytes = b"",
           mode: int = 0o644, mtime: int = 1_600_000_000, size_field: bytes | None = None,
           mtime_field: bytes | None = None, prefix: bytes = b"", checksum_delta: int = 0,
           magic: bytes = b"ustar\x0000") -> bytes:
    """One 512-byte header. `size_field`/`mtime_field` override the octal encoding (12 bytes,
    e.g. base-256); `checksum_delta` makes the checksum lie."""
    buf = bytearray(BLOCK)
    buf[0:100] = name[:100].ljust(100, b"\0")
    buf[100:108] = b"%07o\0" % mode
    buf[108:116] = b"0000000\0"
    buf[116:124] = b"0000000\0"
    buf[124:136] = size_field if size_field is not None else b"%011o\0" % size
    buf[136:148] = mtime_field if mtime_field is not None else b"%011o\0" % mtime
    buf[148:156] = b" " * 8
    buf[156:157] = typeflag
    buf[157:257] = linkname[:100].ljust(100, b"\0")
    buf[257:265] = magic
    buf[345:500] = prefix[:155].ljust(155, b"\0")
    buf[148:156] = b"%06o\0 " % (sum(buf) + checksum_delta)
    return bytes(buf)


def member(name: bytes, data: bytes = b"", **kw: object) -> bytes:
    kw.setdefault("size", len(data))  # type: ignore[arg-type]
    return header(name, **kw) + _pad(data)  # type: ignore[arg-type]


def directory(name: bytes, **kw: object) -> bytes:
    return header(name, typeflag=b"5", mode=0o755, **kw)  # type: ignore[arg-type]


def symlink(name: bytes, target: bytes) -> bytes:
    return header(name, typeflag=b"2", linkname=target, mode=0o777)


def hardlink(name: bytes, target: bytes) -> bytes:
    return header(name, typeflag=b"1", linkname=target)


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))
    return b"%d" % length + body


def pax(records: list[tuple[bytes, bytes]], typeflag: bytes = b"x") -> bytes:
    body = b"".join(pax_record(k, v) for k, v in records)
    return member(b"PaxHeaders/x", body, typeflag=typeflag)


def gnu_long(name: bytes, typeflag: bytes = b"L") -> bytes:
    return member(b"././@LongLink", name + b"\0", typeflag=typeflag, magic=b"ustar  \0")


def base256(value: int, width: int = 12) -> bytes:
    raw = (value % (1 << (8 * width - 1))).to_bytes(width, "big")
    return bytes([raw[0] | 0x80 | (0x40 if value < 0 else 0)]) + raw[1:]


END = bytes(2 * BLOCK)


def tar(*parts: bytes) -> bytes:
    return b"".join(parts) + END


# -- the corpus --------------------------------------------------------------------------------


def build_cases() -> list[Case]:
    rng = random.Random(7)
    ok = member(b"ok.txt", b"fine\n")
    ok_files = {b"ok.txt": b"fine\n"}
    cases: list[Case] = []

    def bad(name: str, data: bytes, why: str, error: str) -> None:
        cases.append(Case(name, data, why, error=error))

    def good(name: str, data: bytes, why: str, files: dict[bytes, bytes],
             skipped: dict[str, int] | None = None, links: dict[bytes, bytes] | None = None,
             dirs_at_least: int = 0) -> None:
        cases.append(Case(name, data, why, files=files, skipped=skipped or {},
                          links=links or {}, dirs_at_least=dirs_at_least))

    # -- unusable shards: the mount fails and names the shard ------------------------------
    bad("empty.tar", b"", "zero-length archive", "empty archive")
    bad("garbage.tar", rng.randbytes(10_000), "random bytes", "not a tar archive")
    bad("gzipped.tar", gzip.compress(tar(ok), mtime=0), "gzip data named .tar", "gzip")
    bad("truncated-header.tar", ok + header(b"next", size=10)[:300], "cut inside a header",
        "truncated header")
    bad("truncated-body.tar", header(b"big.bin", size=100_000) + rng.randbytes(5000),
        "cut inside member data", "truncated member data")
    bad("bad-checksum-first.tar", tar(member(b"a", b"x", checksum_delta=1)),
        "first header's checksum is wrong", "bad header checksum")
    bad("bad-checksum-later.tar", tar(ok, member(b"b", b"y", checksum_delta=-7)),
        "a later header's checksum is wrong", "bad header checksum")
    bad("negative-size.tar", tar(member(b"neg", b"", size_field=base256(-4096))),
        "base-256 negative size", "bad member size")
    bad("huge-size.tar", tar(member(b"huge", b"", size_field=base256(1 << 62))),
        "base-256 size of 4 EiB", "bad member size")
    bad("size-past-eof.tar", header(b"far.bin", size=10 * MiB) + bytes(2048),
        "data offset and size run past the end of the shard", "truncated member data")
    bad("octal-garbage-size.tar", tar(member(b"s", b"", size_field=b"12x4\0       ")),
        "non-octal size field", "bad numeric field")
    bad("pax-size-huge.tar", tar(pax([(b"size", b"9" * 25)]), member(b"p", b"")),
        "pax size of 25 digits", "bad pax size")
    bad("pax-size-negative.tar", tar(pax([(b"size", b"-1")]), member(b"p", b"")),
        "negative pax size", "bad pax size")
    bad("pax-size-past-eof.tar", tar(pax([(b"size", b"%d" % (50 * MiB))]), member(b"p", b"x")),
        "pax size override far past the end", "truncated member data")
    bad("pax-bad-record.tar", tar(member(b"PaxHeaders/x", b"zz path=x\n", typeflag=b"x"),
                                  member(b"p", b"")),
        "malformed pax record", "bad pax header record")
    bad("gnu-longname-over-1mib.tar", tar(gnu_long(b"n" * (MiB + 1)), member(b"p", b"")),
        "GNU long name over the 1 MiB limit", "too large")
    good("longname-without-member.tar", gnu_long(b"orphan") + END,
         "GNU long name with no member after it (GNU tar ignores it)", {},
         {"extended-header-without-member": 1})

    # -- usable shards: bad members skipped and counted, nothing escapes ---------------------
    good("only-end-marker.tar", END, "no members at all", {})
    good("dotdot-names.tar", tar(member(b"../evil", b"x"), member(b"a/../../evil2", b"x"),
                                 member(b"ok/./../../../evil3", b"x"), ok),
         "names climbing out with ..", ok_files, {"unsafe-name": 3})
    good("absolute-names.tar", tar(member(b"/etc/evil", b"x"), member(b"//abs", b"x"),
                                   member(b"///", b"x"), ok),
         "absolute names lose their leading '/' (as in GNU tar)",
         {**ok_files, b"etc/evil": b"x", b"abs": b"x"}, {"root-dir": 1})
    good("prefix-escape.tar", tar(member(b"x", b"x", prefix=b"../.."), ok),
         "ustar prefix field with ..", ok_files, {"unsafe-name": 1})
    good("symlinks-out.tar", tar(ok, symlink(b"abs", b"/etc/passwd"),
                                 symlink(b"up", b"../../../etc"),
                                 symlink(b"d/up2", b"../.."), symlink(b"d/empty", b""),
                                 symlink(b"in", b"ok.txt")),
         "symlinks to absolute paths and above the root", ok_files,
         {"symlink-escapes": 4}, {b"in": b"ok.txt"})
    good("symlink-through-symlink.tar",
         tar(directory(b"d"), symlink(b"d/l", b".."), symlink(b"d/l2", b"l/.."),
             symlink(b"d/l3", b"l/../../etc/passwd"), symlink(b"x", b"d/l/d/l/.."), ok),
         "a '..' after a symlink climbs out (lexically it stays inside)", ok_files,
         {"symlink-escapes": 3}, {b"d/l": b".."})
    good("symlink-loops.tar",
         tar(symlink(b"a", b"b"), symlink(b"b", b"a"), symlink(b"self", b"self"),
             directory(b"d"), symlink(b"d/up", b".."), symlink(b"d/here", b"."), ok),
         "symlink loops and cycles through directories", ok_files, {},
         {b"a": b"b", b"b": b"a", b"self": b"self", b"d/up": b"..", b"d/here": b"."})
    good("hardlinks-out.tar",
         tar(member(b"f", b"data of f"), hardlink(b"h1", b"../../etc/passwd"),
             hardlink(b"h2", b"/etc/passwd"), hardlink(b"h3", b"missing"), hardlink(b"h4", b"f"),
             hardlink(b"../h5", b"f")),
         "hard links to outside, missing targets, an unsafe link name",
         {b"f": b"data of f", b"h4": b"data of f"},
         {"hardlink-missing-target": 3, "unsafe-name": 1})
    good("hardlink-loops.tar",
         tar(hardlink(b"h1", b"h2"), hardlink(b"h2", b"h1"), hardlink(b"h3", b"h3"),
             symlink(b"s", b"ok.txt"), hardlink(b"h4", b"s"), directory(b"dd"),
             hardlink(b"h5", b"dd"), ok),
         "hard links in loops, to a symlink, to a directory", ok_files,
         {"hardlink-missing-target": 5}, {b"s": b"ok.txt"})
    good("devices.tar",
         tar(header(b"dev/null", typeflag=b"3"), header(b"dev/sda", typeflag=b"4"),
             header(b"dev/fifo", typeflag=b"6"), ok),
         "character and block devices, a FIFO", ok_files, {"device": 2, "fifo": 1})
    good("pax-path-escape.tar",
         tar(pax([(b"path", b"../../escape")]), member(b"innocent1", b"x"),
             pax([(b"path", b"/abs")]), member(b"innocent2", b"x"),
             pax([(b"linkpath", b"/etc/shadow")]), symlink(b"innocent3", b"ok.txt"), ok),
         "pax records overriding path and linkpath maliciously ('/abs' loses its '/')",
         {**ok_files, b"abs": b"x"}, {"unsafe-name": 1, "symlink-escapes": 1})
    good("pax-global-path.tar",
         tar(pax([(b"path", b"../evil")], typeflag=b"g"), member(b"m1", b"1"),
             member(b"m2", b"2"), pax([(b"path", b"")], typeflag=b"g"), ok),
         "a global pax header renaming every later member out of the tree", ok_files,
         {"unsafe-name": 2})
    big = rng.randbytes(5000)
    good("pax-size-override.tar", tar(pax([(b"size", b"5000")]), header(b"sized.bin", size=0)
                                      + _pad(big), ok),
         "pax size disagrees with the header (consistent with the data)",
         {b"sized.bin": big, **ok_files})
    good("gnu-longname-1mib.tar", tar(gnu_long(b"a" * (MiB - 1)), member(b"ignored", b"x"),
                                      member(b"z.txt", b"sibling")),
         "a GNU long name of 1 MiB (one component: longer than NAME_MAX)",
         {b"z.txt": b"sibling"}, {"unsafe-name": 1})
    good("component-300.tar", tar(member(b"x" * 90 + b"/" + b"y" * 9, b"short"),
                                  pax([(b"path", b"d/" + b"q" * 300)]), member(b"p", b"x"),
                                  member(b"zz", b"z")),
         "a 300-byte path component", {b"x" * 90 + b"/" + b"y" * 9: b"short", b"zz": b"z"},
         {"unsafe-name": 1})
    good("nul-in-names.tar",
         tar(member(b"a\0hidden-after-nul", b"A"), pax([(b"path", b"b\0c")]),
             member(b"bb", b"B"), gnu_long(b"c\0d"), member(b"cc", b"C")),
         "NUL bytes inside names (ustar field, pax path, GNU long name): cut there",
         {b"a": b"A", b"b": b"B", b"c": b"C"})
    good("non-utf8-names.tar",
         tar(member(b"\xff\xfe.bin", b"1"), member(b"caf\xe9/\x80\x81.txt", b"2"),
             member(b"ok-\xc3\xa9.txt", b"3")),
         "names that are not UTF-8",
         {b"\xff\xfe.bin": b"1", b"caf\xe9/\x80\x81.txt": b"2", b"ok-\xc3\xa9.txt": b"3"})
    deep = b"d/" * 10_000 + b"leaf.txt"
    good("deep-10000.tar", tar(pax([(b"path", deep)]), member(b"p", b"deep"), ok),
         "a path 10 000 directories deep", {deep: b"deep", **ok_files}, dirs_at_least=10_000)
    good("duplicates.tar", tar(member(b"same.txt", b"first"), member(b"same.txt", b"second"),
                               member(b"same.txt", b"third")),
         "one name three times: the last one wins", {b"same.txt": b"third"})
    good("file-dir-conflict.tar", tar(member(b"x", b"file"), member(b"x/y", b"under")),
         "a file that other members use as a directory", {b"x/y": b"under"})
    good("dir-with-size.tar", tar(directory(b"d", size=5000), member(b"d/f", b"f")),
         "a directory header claiming 5000 bytes of data", {b"d/f": b"f"})
    good("setuid-mode.tar", tar(member(b"suid", b"#!/bin/sh\n", mode=0o7777)),
         "setuid/setgid/sticky and write bits in the mode", {b"suid": b"#!/bin/sh\n"})
    good("extreme-mtimes.tar", tar(member(b"future", b"f", mtime_field=base256(1 << 80)),
                                   member(b"past", b"p", mtime_field=base256(-(1 << 80)))),
         "mtimes far outside any clock", {b"future": b"f", b"past": b"p"})
    good("root-and-dots.tar", tar(directory(b"./"), directory(b"."), member(b"...", b"3 dots"),
                                  member(b"./././/a", b"a")),
         "entries naming the root itself, a file named '...'",
         {b"...": b"3 dots", b"a": b"a"}, {"root-dir": 2})
    good("unknown-types.tar", tar(member(b"z", b"zz", typeflag=b"Z"),
                                  header(b"label", typeflag=b"V"), ok),
         "unknown type flag with data, a volume label", ok_files,
         {"unsupported-type-Z": 1, "volume-label": 1})
    good("gnu-sparse.tar", tar(member(b"sp", b"s" * 512, typeflag=b"S"), ok),
         "an old GNU sparse member with an empty map: an empty file", {**ok_files, b"sp": b""})
    bad_map = bytearray(header(b"sp2", size=512, typeflag=b"S"))
    bad_map[386:410] = b"%011o\0%011o\0" % (100, 600)  # a run past the real size (0)
    bad_map[148:156] = b" " * 8
    bad_map[148:156] = b"%06o\0 " % sum(bad_map)
    good("gnu-sparse-bad-map.tar", tar(bytes(bad_map) + b"s" * 512, ok),
         "an old GNU sparse member whose map passes its end", ok_files, {"bad-sparse-map": 1})
    return cases


def build_corpus(directory: Path) -> list[Case]:
    directory.mkdir(parents=True, exist_ok=True)
    cases = build_cases()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "duplicate case names"
    for case in cases:
        (directory / case.name).write_bytes(case.data)
    return cases


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile-corpus")
    built = build_corpus(out)
    print(f"{len(built)} shards in {out} "
          f"({sum(c.error is not None for c in built)} unusable)")
