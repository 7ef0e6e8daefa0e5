"""Benchmark data: an ImageFolder of real JPEGs, its shards (+ shardfs index files), a wids
index, and a synthetic many-member tar (+ optional loose tree) for the metadata scenario.

Everything is deterministic from the parameters and kept under the output dir, so a second run
with the same parameters reuses it (a marker file records the parameters).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from shardfs.catalog.shardindex import INDEX_SUFFIX, KIND_FILE, ShardIndex, encode_index
from shardfs.devtools.datagen import make_imagefolder
from shardfs.pack import pack

MARKER = "bench-data.json"


@dataclass(frozen=True)
class DataParams:
    classes: int
    per_class: int
    mean_kb: float
    shard_mb: float
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class Dataset:
    params: DataParams
    www: Path  # served root: loose/train/<class>/<file>.JPEG and shards/train-NNNNNN.tar
    files: int
    loose_bytes: int  # sum of the member file sizes (what an epoch reads)
    shard_names: list[str]  # relative to www/shards
    shard_bytes: int
    samples_per_shard: list[int]
    gen_s: float
    pack_s: float

    @property
    def loose(self) -> Path:
        return self.www / "loose"

    @property
    def shards(self) -> Path:
        return self.www / "shards"

    def shard_pattern(self, base_url: str) -> str:
        n = len(self.shard_names)
        return f"{base_url}/shards/train-{{{0:06d}..{n - 1:06d}}}.tar"

    def shard_urls(self, base_url: str) -> list[str]:
        return [f"{base_url}/shards/{name}" for name in self.shard_names]

    def wids_index(self, base_url: str) -> dict:
        return {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "name": "shardfs-bench",
            "shardlist": [
                {"url": url, "nsamples": n, "filesize": (self.shards / name).stat().st_size}
                for url, name, n in zip(self.shard_urls(base_url), self.shard_names,
                                        self.samples_per_shard, strict=True)
            ],
        }


def _load_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return None


def prepare_dataset(params: DataParams, base: Path, say: Callable[[str], None]) -> Dataset:
    www = base / f"images-{params.key()}"
    marker = _load_marker(www)
    if marker is not None and marker.get("params") == asdict(params):
        say(f"reusing dataset {www} ({marker['files']} files, "
            f"{marker['loose_bytes'] / 1e6:.1f} MB, {len(marker['shard_names'])} shards)")
        return Dataset(params=params, www=www, **{k: v for k, v in marker.items()
                                                  if k != "params"})
    shutil.rmtree(www, ignore_errors=True)
    total = params.classes * params.per_class
    say(f"generating {total} JPEGs ({params.classes} classes x {params.per_class}, mean "
        f"{params.mean_kb:g} KiB, seed {params.seed}) ...")
    t = time.monotonic()
    last = [t]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 10 or done == total:
            last[0] = now
            say(f"  {done}/{total} JPEGs")

    files = make_imagefolder(www / "loose", classes=params.classes, per_class=params.per_class,
                             mean_kb=params.mean_kb, seed=params.seed, progress=progress)
    gen_s = time.monotonic() - t
    loose_bytes = sum(f.stat().st_size for f in files)
    t = time.monotonic()
    result = pack(www / "loose", www / "shards", prefix="train",
                  shard_size=int(params.shard_mb * 2**20), shuffle=True, seed=params.seed)
    pack_s = time.monotonic() - t
    say(f"packed {len(files)} files ({loose_bytes / 1e6:.1f} MB) into {len(result.shards)} "
        f"shards of ~{params.shard_mb:g} MiB in {pack_s:.1f} s (generation took {gen_s:.1f} s)")
    record = {
        "files": len(files),
        "loose_bytes": loose_bytes,
        "shard_names": [s.path.name for s in result.shards],
        "shard_bytes": result.nbytes,
        "samples_per_shard": [s.nsamples for s in result.shards],
        "gen_s": round(gen_s, 3),
        "pack_s": round(pack_s, 3),
    }
    (www / MARKER).write_text(json.dumps({"params": asdict(params), **record}, indent=1))
    return Dataset(params=params, www=www, **record)


# --- metadata scale: many zero-byte members ----------------------------------------------------

META_FORMAT = 1


@dataclass
class MetaDataset:
    www: Path  # meta/train.tar (+ .shardfs.idx), metaloose/train/cNNNN/fNNNNNNNN.jpg
    files: int
    dirs: int
    tar_bytes: int
    loose: bool  # whether the loose tree exists
    build_s: float

    @property
    def tar(self) -> Path:
        return self.www / "meta" / "train.tar"

    @property
    def loose_root(self) -> Path:
        return self.www / "metaloose"


def _member_name(i: int, dirs: int) -> bytes:
    return b"train/c%04d/f%08d.jpg" % (i % dirs, i)


def write_many_member_tar(path: Path, files: int, dirs: int) -> ShardIndex:
    """A ustar archive of `files` zero-byte members, written header by header (fast), and the
    matching shardfs index (member offsets are known without re-reading the tar)."""
    template = bytearray(512)
    # name(100) mode(8) uid(8) gid(8) size(12) mtime(12) chksum(8) typeflag(1) linkname(100)
    # magic(6) version(2) uname(32) gname(32) devmajor(8) devminor(8) prefix(155)
    template[100:108] = b"0000644\0"
    template[108:116] = b"0000000\0"
    template[116:124] = b"0000000\0"
    template[124:136] = b"00000000000\0"
    template[136:148] = b"13560771400\0"  # 2020-01-01
    template[148:156] = b" " * 8
    template[156:157] = b"0"
    template[257:263] = b"ustar\0"
    template[263:265] = b"00"
    base_sum = sum(template)
    index = ShardIndex(size=0)
    offsets = array("Q")
    with open(path, "wb", buffering=1 << 22) as f:
        pos = 0
        for i in range(files):
            name = _member_name(i, dirs)
            header = bytearray(template)
            header[0:len(name)] = name
            chk = base_sum + sum(name)
            header[148:156] = b"%06o\0 " % chk
            f.write(header)
            pos += 512
            offsets.append(pos)  # data offset of a zero-byte member: right after its header
            index.paths.append(name)
        f.write(bytes(1024))
        pos += 1024
        pad = -pos % 10240
        f.write(bytes(pad))
        pos += pad
    n = files
    index.size = pos
    index.kinds = bytearray([KIND_FILE]) * n
    index.offsets = offsets
    index.sizes = array("Q", bytes(8 * n))
    index.mtimes = array("q", [1577836800]) * n
    index.modes = array("H", [0o644]) * n
    return index


def prepare_meta(files: int, dirs: int, loose: bool, base: Path,
                 say: Callable[[str], None]) -> MetaDataset:
    www = base / f"meta-{files}-{dirs}"
    marker = _load_marker(www)
    want = {"format": META_FORMAT, "files": files, "dirs": dirs}
    if marker is not None and marker.get("params") == want and (marker["loose"] or not loose):
        say(f"reusing metadata tree {www} ({files} members)")
        return MetaDataset(www=www, **{k: v for k, v in marker.items() if k != "params"})
    shutil.rmtree(www, ignore_errors=True)
    (www / "meta").mkdir(parents=True)
    t = time.monotonic()
    say(f"writing a tar of {files} zero-byte members in {dirs} directories ...")
    tar = www / "meta" / "train.tar"
    index = write_many_member_tar(tar, files, dirs)
    (www / "meta" / ("train.tar" + INDEX_SUFFIX)).write_bytes(encode_index(index))
    if loose:
        say(f"writing the matching loose tree ({files} empty files) ...")
        root = www / "metaloose"
        for j in range(dirs):
            (root / "train" / f"c{j:04d}").mkdir(parents=True)
        for i in range(files):
            fd = os.open(root / os.fsdecode(_member_name(i, dirs)), os.O_CREAT | os.O_WRONLY,
                         0o644)
            os.close(fd)
    build_s = time.monotonic() - t
    record = {"files": files, "dirs": dirs, "tar_bytes": tar.stat().st_size, "loose": loose,
              "build_s": round(build_s, 3)}
    (www / MARKER).write_text(json.dumps({"params": want, **record}))
    say(f"metadata data ready in {build_s:.1f} s ({record['tar_bytes'] / 1e6:.0f} MB tar)")
    return MetaDataset(www=www, **record)
