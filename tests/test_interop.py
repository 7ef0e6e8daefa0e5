"""Interop: shards written by other tools mount correctly; shardfs pack output loads in wids."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.conftest import Dataset, Mounter

LONG = "deep/" + "d" * 120 + "/" + "n" * 150 + ".bin"  # > 100 and > 255 bytes in total
UNICODE = "klasse_ü/bild_日本語_ø.jpg"


def sample_files() -> dict[str, bytes]:
    files = {f"c{i % 3}/s{i:03d}.{ext}": os.urandom(500 + 97 * i)
             for i in range(12) for ext in ("jpg", "cls")}
    files[LONG] = os.urandom(3000)
    files[UNICODE] = os.urandom(2000)
    return files


def assert_mounted(mounter: Mounter, source: str, files: dict[str, bytes]) -> None:
    m = mounter.mount([source])
    for name, data in files.items():
        assert (m.mountpoint / name).read_bytes() == data, name
    found = {str(p.relative_to(m.mountpoint)) for p in m.mountpoint.rglob("*") if p.is_file()}
    assert found == set(files)


@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar"])
def test_gnu_tar_formats(fmt: str, tmp_path: Path, mounter: Mounter):
    if shutil.which("tar") is None:
        pytest.skip("GNU tar not installed")
    files = sample_files()
    if fmt == "ustar":  # ustar cannot hold a 150-byte file name component
        files.pop(LONG)
    src = tmp_path / "src"
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    shard = tmp_path / f"gnu-{fmt}.tar"
    subprocess.run(["tar", f"--format={fmt}", "-cf", str(shard), "-C", str(src), "."],
                   check=True)
    assert_mounted(mounter, str(shard), files)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_python_tarfile_formats(fmt: int, tmp_path: Path, mounter: Mounter):
    files = sample_files()
    if fmt == tarfile.USTAR_FORMAT:
        files.pop(LONG)
    shard = tmp_path / f"py-{fmt}.tar"
    with tarfile.open(shard, "w", format=fmt) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    assert_mounted(mounter, str(shard), files)


def test_webdataset_shardwriter_shards(tmp_path: Path, mounter: Mounter):
    wds = pytest.importorskip("webdataset")
    files: dict[str, bytes] = {}
    pattern = str(tmp_path / "wds-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=7) as sink:
        for i in range(20):
            sample = {"__key__": f"train/c{i % 4}/s{i:04d}", "jpg": os.urandom(700 + i),
                      "cls": str(i % 4).encode(), "seg.png": os.urandom(300)}
            sink.write(sample)
            for ext in ("jpg", "cls", "seg.png"):
                files[f"{sample['__key__']}.{ext}"] = sample[ext]
    shards = sorted(tmp_path.glob("wds-*.tar"))
    assert len(shards) == 3
    assert_mounted(mounter, str(tmp_path / "wds-{000000..000002}.tar"), files)


def test_pack_output_loads_in_wids(dataset: Dataset, tmp_path: Path):
    wids = pytest.importorskip("wids")
    shards = [{"url": str(s.path), "nsamples": s.nsamples} for s in dataset.shards.shards]
    ds = wids.ShardListDataset(shards, cache_dir=str(tmp_path / "wids-cache"),
                               transformations=[])
    assert len(ds) == dataset.shards.nsamples
    expected = dataset.files()
    for i in range(len(ds)):
        sample = ds[i]
        key = sample["__key__"].lstrip("./")
        data = [v for k, v in sample.items() if not k.startswith("__")]
        assert len(data) == 1
        blob = data[0].read() if hasattr(data[0], "read") else data[0]
        assert blob == expected[f"{key}.JPEG"]
