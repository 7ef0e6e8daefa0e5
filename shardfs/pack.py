"""Turn a directory tree into WebDataset-convention tar shards (`shardfs pack`).

Format: POSIX tar as written by `tarfile.PAX_FORMAT` headers — a plain ustar header per member
when its name is ASCII and fits in 100 bytes (the common case), preceded by a per-member pax
extended header ('x') only when needed (longer or non-ASCII names, files >= 8 GiB). Only regular
files are stored (no directory members: WebDataset convention); a sample's files (same key =
path up to the first dot of the basename) are consecutive and never split across shards.
Headers are normalized (fixed mtime, uid/gid 0, empty user/group names, mode 0644) so that
packing the same tree twice gives byte-identical shards.

`--format zip` writes zip shards instead (packzip.py): stored members, same grouping, same
reproducibility, an index beside each shard as for tar.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import stat
import struct
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from shardfs import packzip
from shardfs.catalog.shardindex import INDEX_SUFFIX, ShardIndex, encode_index
from shardfs.catalog.tar import Member
from shardfs.util.checksum import ShardSums
from shardfs.util.progress import ProgressLine
from shardfs.util.sizes import UNITS_HELP, format_size, parse_size

BLOCK = 512
RECORD = tarfile.RECORDSIZE  # archives end padded to 20 blocks, like GNU tar and tarfile
FIXED_MTIME = 1577836800  # 2020-01-01T00:00:00Z: stored unless keep_mtime, for reproducibility
FILE_MODE = 0o644
SHARD_MODE = 0o644  # mkstemp creates 0600; shards are meant to be served
CHUNK = 1 << 20
FORMATS = ("tar", "zip")

Progress = Callable[[int, int], None]


class PackError(Exception):
    """Packing failed; the message names the offending file or path, phrased for the user."""


@dataclass(frozen=True, slots=True)
class ShardRecord:
    path: Path
    size: int
    sha256: str
    crc32c: str
    nsamples: int
    members: list[tuple[str, int, int, int]]  # (name, data offset, size, mtime)


@dataclass(slots=True)
class PackResult:
    shards: list[ShardRecord]
    pattern: str  # brace pattern naming all shards, e.g. out/shard-{000000..000012}.tar
    skipped: list[str] = field(default_factory=list)  # non-regular entries left out

    @property
    def nsamples(self) -> int:
        return sum(s.nsamples for s in self.shards)

    @property
    def nfiles(self) -> int:
        return sum(len(s.members) for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.shards)


@dataclass(frozen=True, slots=True)
class _SourceFile:
    name: str  # member name: relative to src, '/'-separated
    path: str  # where to read it
    size: int
    mtime: int


@dataclass(frozen=True, slots=True)
class _Sample:
    key: str
    files: list[_SourceFile]
    tar_bytes: int  # headers + padded data, as it will be laid out in the shard (tar), or
    # local header + data + central directory entry (zip)


def split_key(name: str) -> tuple[str, str]:
    """WebDataset sample key and extension: 'a/b/x.seg.png' -> ('a/b/x', 'seg.png')."""
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext


def _padded(n: int, unit: int = BLOCK) -> int:
    return -(-n // unit) * unit


def _shard_file_size(member_bytes: int, fmt: str = "tar") -> int:
    """Final shard size: members + two zero end blocks, padded to a whole record (tar);
    members and their central entries + the end records, ZIP64 ones included (zip)."""
    if fmt == "zip":
        return member_bytes + 98
    return _padded(member_bytes + 2 * BLOCK, RECORD)


def _cost(f: _SourceFile, fmt: str) -> int:
    if fmt == "zip":
        name = f.name.encode()
        return (packzip.local_header_size(name, f.size) + f.size
                + packzip.central_entry_size(name, f.size, 1 << 32))
    return len(_header(f)) + _padded(f.size)


def _header(f: _SourceFile) -> bytes:
    info = tarfile.TarInfo(f.name)
    info.size, info.mtime, info.mode = f.size, f.mtime, FILE_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


# --- walking the source tree -------------------------------------------------------------------


def _raise_walk_error(err: OSError) -> None:
    raise PackError(f"cannot read directory {err.filename}: {err.strerror}") from err


def _walk(src: Path, keep_mtime: bool) -> tuple[list[_SourceFile], list[str]]:
    """Regular files under src (symlinks are neither followed nor stored), and what was skipped."""
    files: list[_SourceFile] = []
    skipped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src, onerror=_raise_walk_error):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, src)
        prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        # os.walk lists symlinks to directories among dirnames but does not descend into them.
        skipped.extend(prefix + d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))
        for fname in sorted(filenames):
            path = os.path.join(dirpath, fname)
            try:
                st = os.lstat(path)
            except OSError as err:
                raise PackError(f"cannot stat {path}: {err.strerror}") from err
            if not stat.S_ISREG(st.st_mode):
                skipped.append(prefix + fname)
                continue
            name = prefix + fname
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise PackError(f"file name is not valid UTF-8: {path!r}") from None
            mtime = int(st.st_mtime) if keep_mtime else FIXED_MTIME
            files.append(_SourceFile(name, path, st.st_size, mtime))
    return files, sorted(skipped)


def _group(files: Iterable[_SourceFile], fmt: str = "tar") -> list[_Sample]:
    """Samples sorted by key, files within a sample sorted by name (a dict, not runs: paths
    like 'a/x.d/y.jpg' sort between 'a/x.a' and 'a/x.z' yet belong to another sample)."""
    by_key: dict[str, list[_SourceFile]] = {}
    for f in files:
        by_key.setdefault(split_key(f.name)[0], []).append(f)
    samples = []
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda f: f.name)
        cost = sum(_cost(f, fmt) for f in members)
        samples.append(_Sample(key, members, cost))
    return samples


def _plan(samples: list[_Sample], shard_size: int,
          samples_per_shard: int | None, fmt: str = "tar") -> list[list[_Sample]]:
    """Cut the sample sequence into shards; a lone oversize sample gets a shard of its own."""
    shards: list[list[_Sample]] = []
    current: list[_Sample] = []
    used = 0
    for sample in samples:
        full = samples_per_shard is not None and len(current) >= samples_per_shard
        if current and (full or _shard_file_size(used + sample.tar_bytes, fmt) > shard_size):
            shards.append(current)
            current, used = [], 0
        current.append(sample)
        used += sample.tar_bytes
    if current:
        shards.append(current)
    return shards


# --- writing shards ----------------------------------------------------------------------------


class _HashingWriter:
    """Writes through to a file while tracking the offset and the digests of everything written."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self.fileobj = fileobj
        self.offset = 0
        self.digest = ShardSums()
        self.crc = 0  # CRC-32 of what was written since it was last reset (zip members)

    def write(self, data: bytes | memoryview) -> None:
        self.fileobj.write(data)
        self.digest.update(data)
        self.crc = zlib.crc32(data, self.crc)
        self.offset += len(data)


def _copy_data(f: _SourceFile, out: _HashingWriter, pad: bool = True) -> None:
    """Copy exactly f.size bytes; the header is already written, so any change is an error."""
    try:
        # O_NOFOLLOW/O_NONBLOCK: never follow a symlink or hang on a FIFO swapped in since the walk.
        fd = os.open(f.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise PackError(f"cannot read {f.path}: {err.strerror}") from err
    with open(fd, "rb", buffering=0) as src:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackError(f"cannot read {f.path}: no longer a regular file")
        remaining = f.size
        try:
            while remaining:
                chunk = src.read(min(CHUNK, remaining))
                if not chunk:
                    raise PackError(f"{f.path} shrank while packing "
                                    f"(expected {f.size} bytes, got {f.size - remaining})")
                out.write(chunk)
                remaining -= len(chunk)
            if src.read(1):
                raise PackError(f"{f.path} grew while packing (expected {f.size} bytes)")
        except OSError as err:
            raise PackError(f"cannot read {f.path}: {err.strerror}") from err
    if pad:
        out.write(bytes(_padded(f.size) - f.size))


def _write_zip(raw: BinaryIO, fd: int, samples: list[_Sample],
               on_file: Callable[[], None]
               ) -> tuple[int, tuple[str, str], list[tuple[str, int, int, int]]]:
    """The zip layout (packzip.py): local headers and data, then each member's CRC-32
    written into its local header, then the central directory. Returns (size, (sha256,
    crc32c), members); the digests are taken from the finished file (the CRCs go in
    afterwards)."""
    out = _HashingWriter(raw)
    members: list[tuple[str, int, int, int]] = []
    central = []
    crcs: list[tuple[int, int]] = []  # (local header offset, CRC-32)
    for sample in samples:
        for f in sample.files:
            name = f.name.encode()
            header = out.offset
            out.write(packzip.local_header(name, f.size, f.mtime))
            members.append((f.name, out.offset, f.size, f.mtime))
            out.crc = 0
            _copy_data(f, out, pad=False)
            central.append(packzip.central_entry(name, f.size, f.mtime, out.crc, header))
            crcs.append((header, out.crc))
            on_file()
    raw.flush()
    for header, crc in crcs:
        os.pwrite(fd, struct.pack("<L", crc), header + packzip.CRC_AT)
    cd_start = out.offset
    for entry in central:
        out.write(entry)
    out.write(packzip.end_records(len(central), cd_start, out.offset - cd_start))
    raw.flush()
    digest = ShardSums()
    with open(fd, "rb", buffering=0, closefd=False) as back:
        back.seek(0)
        while chunk := back.read(CHUNK):
            digest.update(chunk)
    return out.offset, digest.hexdigests(), members


def _write_shard(path: Path, samples: list[_Sample], on_file: Callable[[], None],
                 fmt: str = "tar") -> ShardRecord:
    """Write one shard to a temp file in the same directory, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    members: list[tuple[str, int, int, int]] = []
    try:
        if fmt == "zip":
            with open(fd, "w+b", buffering=CHUNK) as raw:
                size, digests, members = _write_zip(raw, fd, samples, on_file)
        else:
            with open(fd, "wb", buffering=CHUNK) as raw:
                out = _HashingWriter(raw)
                for sample in samples:
                    for f in sample.files:
                        out.write(_header(f))
                        members.append((f.name, out.offset, f.size, f.mtime))
                        _copy_data(f, out)
                        on_file()
                out.write(bytes(_shard_file_size(out.offset) - out.offset))
            size, digests = out.offset, out.digest.hexdigests()
        os.chmod(tmp, SHARD_MODE)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    record = ShardRecord(path, size, *digests, len(samples), members)
    _write_index(record)
    return record


def index_path(shard: Path) -> Path:
    return shard.with_name(shard.name + INDEX_SUFFIX)


def _write_index(record: ShardRecord) -> None:
    """The shard's index file beside it, so mounts list it without reading the shard."""
    index = ShardIndex(size=record.size, sha256=record.sha256, crc32c=record.crc32c)
    for name, offset, size, mtime in record.members:
        index.add(Member(name.encode(), "f", offset, size, mtime, FILE_MODE))
    path = index_path(record.path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(encode_index(index))
    os.replace(tmp, path)


def _shard_name(prefix: str, index: int, fmt: str = "tar") -> str:
    return f"{prefix}-{index:06d}.{fmt}"


def _prepare_out(out: Path, prefix: str, force: bool, fmt: str = "tar") -> None:
    """Create out; refuse to mix with (or, with force, remove) earlier shards of this prefix."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PackError(f"cannot create output directory {out}: {err.strerror}") from err
    pattern = re.compile(rf"{re.escape(prefix)}-\d{{6,}}\.{fmt}")
    existing = sorted(n for n in os.listdir(out) if pattern.fullmatch(n))
    if existing and not force:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise PackError(f"refusing to overwrite {out / existing[0]}{more}; "
                        f"use --force to replace the '{prefix}' shards")
    for name in existing:
        (out / name).unlink()
        index_path(out / name).unlink(missing_ok=True)


def _pattern(out: Path, prefix: str, count: int, fmt: str = "tar") -> str:
    if count == 1:
        return str(out / _shard_name(prefix, 0, fmt))
    return str(out / f"{prefix}-{{{0:06d}..{count - 1:06d}}}.{fmt}")


def _check_args(src: Path, out: Path, prefix: str, shard_size: int,
                samples_per_shard: int | None) -> None:
    if not src.is_dir():
        raise PackError(f"source {src} is not a directory")
    if not prefix or "/" in prefix or prefix.startswith("."):
        raise PackError(f"invalid shard prefix {prefix!r} (no '/', not empty, no leading '.')")
    if shard_size < 1:
        raise PackError("shard size must be positive")
    if samples_per_shard is not None and samples_per_shard < 1:
        raise PackError("samples per shard must be positive")
    src_real, out_real = src.resolve(), out.resolve()
    if out_real == src_real or src_real in out_real.parents:
        raise PackError(f"output directory {out} is inside the source {src}")


def pack(src: Path, out: Path, *, prefix: str = "shard", shard_size: int = 256 * 2**20,
         samples_per_shard: int | None = None, shuffle: bool = False, seed: int = 0,
         force: bool = False, progress: Progress | None = None,
         keep_mtime: bool = False, fmt: str = "tar") -> PackResult:
    """Pack the regular files under `src` into `out/{prefix}-NNNNNN.tar` shards (`.zip`
    with fmt="zip": stored members).

    A new shard starts when the next sample would push the shard file past `shard_size` bytes
    or when `samples_per_shard` is reached. `shuffle` orders samples with random.Random(seed).
    `progress(done_files, total_files)` is called with (0, total) after the walk, then at least
    every 0.5% of the files and at the end. On failure, shards written by this call are removed.
    """
    src, out = Path(src), Path(out)
    _check_args(src, out, prefix, shard_size, samples_per_shard)
    if fmt not in FORMATS:
        raise PackError(f"unknown shard format {fmt!r} (one of {', '.join(FORMATS)})")
    files, skipped = _walk(src, keep_mtime)
    if not files:
        raise PackError(f"no regular files under {src}")
    samples = _group(files, fmt)
    if shuffle:
        random.Random(seed).shuffle(samples)
    plan = _plan(samples, shard_size, samples_per_shard, fmt)
    _prepare_out(out, prefix, force, fmt)

    total, done = len(files), 0
    step = max(1, total // 200)

    def on_file() -> None:
        nonlocal done
        done += 1
        if progress is not None and (done % step == 0 or done == total):
            progress(done, total)

    if progress is not None:
        progress(0, total)
    records: list[ShardRecord] = []
    try:
        for index, shard_samples in enumerate(plan):
            records.append(_write_shard(out / _shard_name(prefix, index, fmt), shard_samples,
                                        on_file, fmt))
    except BaseException:
        for record in records:
            record.path.unlink(missing_ok=True)
            index_path(record.path).unlink(missing_ok=True)
        raise
    return PackResult(records, _pattern(out, prefix, len(records), fmt), skipped)


# --- command line ------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return size


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be positive")
    return value


def configure_pack_parser(p: argparse.ArgumentParser) -> None:
    """Add `shardfs pack` arguments (the lead's cli.py owns the subparser itself)."""
    p.add_argument("src", metavar="SRC_DIR", help="directory tree to pack (e.g. an ImageFolder)")
    p.add_argument("out", metavar="OUT_DIR", help="where to write the shards (created if needed)")
    p.add_argument("--prefix", default="shard",
                   help="shard file name prefix: PREFIX-000000.tar, ... (default: %(default)s)")
    p.add_argument("--shard-size", type=_size_arg, default=256 * 2**20, metavar="SIZE",
                   help=f"target maximum shard size (default: 256MiB; units: {UNITS_HELP})")
    p.add_argument("--samples-per-shard", type=_positive_int, default=None, metavar="N",
                   help="also start a new shard after N samples")
    p.add_argument("--shuffle", action="store_true",
                   help="shuffle samples (spreads classes over shards; reproducible with --seed)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="replace existing PREFIX-*.tar shards in OUT_DIR")
    p.add_argument("--format", choices=FORMATS, default="tar", dest="shard_format",
                   help="shard format: tar (WebDataset) or zip (stored members); "
                        "default: %(default)s")
    p.add_argument("--keep-mtime", action="store_true",
                   help="store the files' mtimes (default: a fixed date, for reproducible shards)")


def run_pack(args: argparse.Namespace) -> int:
    """Run `shardfs pack`: the shard pattern goes to stdout, progress and summary to stderr."""
    line = ProgressLine("shardfs pack", sys.stderr, unit="files")
    try:
        result = pack(Path(args.src), Path(args.out), prefix=args.prefix,
                      shard_size=args.shard_size, samples_per_shard=args.samples_per_shard,
                      shuffle=args.shuffle, seed=args.seed, force=args.force, progress=line,
                      keep_mtime=getattr(args, "keep_mtime", False),
                      fmt=getattr(args, "shard_format", "tar"))
    except PackError as err:
        line.close()
        print(f"shardfs pack: error: {err}", file=sys.stderr)
        return 2
    line.close()
    if result.skipped:
        print(f"shardfs pack: skipped {len(result.skipped)} entries that are not regular files "
              f"(symlinks, devices, ...), e.g. {result.skipped[0]}", file=sys.stderr)
    print(result.pattern)
    print(f"shardfs pack: {len(result.shards)} shards, {result.nsamples} samples "
          f"({result.nfiles} files), {format_size(result.nbytes)} ({result.nbytes} bytes)",
          file=sys.stderr)
    return 0
