"""MXNet indexed RecordIO: the parser (catalog/recordio.py) on its own, and `.rec` files
through real mounts (file:// and nginx), with and without their `.idx`: ImageFolder targets
equal the labels, every payload byte-equal, split records joined, insightface's header
record skipped.

The .rec files come from tests/recordiokit.py (our writer of the format). With
SHARDFS_MXNET_PYTHON naming a Python that has mxnet (mxnet 1.9.1 needs numpy < 1.24 and does
not install beside this project's numpy), one test also mounts a .rec mxnet wrote."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from shardfs.catalog import recordio
from tests.conftest import SHARDFS, Mount, Mounter
from tests.recordiokit import MAGIC, RecWriter, encode, pack_image
from tests.test_zip_mount import image_folder, loose_files

JPEG, PNG = b"\xff\xd8\xff\xe0", b"\x89PNG\r\n\x1a\n"


def make_rec(base: Path, *, seed: int = 0, with_idx: bool = True,
             insightface: bool = False) -> dict[str, bytes]:
    """Write base.rec (+ base.idx) and return the files the mount must show."""
    r = random.Random(seed)
    expected: dict[str, bytes] = {}
    with RecWriter(base.with_suffix(".rec"), base.with_suffix(".idx") if with_idx else None) as w:
        key = 0
        if insightface:  # record 0: flag 2, labels (first image key, end of identities)
            w.write(key, pack_image([31.0, 33.0], b""))
            key += 1
        for i in range(30):
            label = i % 12  # 0..11: zero-padded to two digits
            magic = PNG if i % 5 == 0 else JPEG
            image = magic + r.randbytes(r.randint(0, 4000))
            if i == 7:  # the magic at a 4-aligned offset of the payload: a split record
                image = JPEG + MAGIC + r.randbytes(40) + MAGIC + b"end"
            if i == 9:  # several labels (flag 2): the first is its class
                payload = pack_image([float(label), 0.25], image, key)
            else:
                payload = pack_image(label, image, key)
            w.write(key, payload)
            expected[f"{label:02d}/{key}.{'png' if magic == PNG else 'jpg'}"] = image
            key += 1
        if insightface:  # identity-range records: labels, no image
            for ident in range(2):
                w.write(key, pack_image([1.0 + ident, 2.0 + ident], b""))
                key += 1
    return expected


def records_of(rec: Path, by_idx: bool) -> recordio.Listing:
    data = rec.read_bytes()
    if by_idx:
        records = []
        for key, offset in recordio.parse_idx(rec.with_suffix(".idx").read_bytes()):
            chunks = [recordio.chunk_at(data[offset : offset + 8], offset)]
            while chunks[-1].cflag not in (0, 3):
                at = chunks[-1].next
                chunks.append(recordio.chunk_at(data[at : at + 8], at))
            first = chunks[0]
            records.append(recordio.Record(key, chunks,
                                           data[offset + 8 : offset + 8 + first.length][:256]))
    else:
        scanner = recordio.RecordScanner()
        for i in range(0, len(data), 777):  # odd pieces: headers cut anywhere
            scanner.feed(data[i : i + 777])
        scanner.finish()
        records = scanner.records
    return recordio.members(records)


def served(rec: Path, listing: recordio.Listing) -> dict[str, bytes]:
    from shardfs.read.packed import decode

    data = rec.read_bytes()
    out = {}
    for m in listing.members:
        if m.packed is None:
            out[m.path.decode()] = data[m.offset : m.offset + m.size]
        else:
            raw = data[m.offset : m.offset + m.packed[1]]
            out[m.path.decode()] = decode(m.packed, raw, m.size)
    return out


@pytest.mark.parametrize("by_idx", [True, False])
def test_parser_members_split_records_and_insightface_header(tmp_path: Path, by_idx: bool):
    expected = make_rec(tmp_path / "t", insightface=True)
    listing = records_of(tmp_path / "t.rec", by_idx)
    assert served(tmp_path / "t.rec", listing) == expected
    assert sum(m.packed is not None for m in listing.members) == 1  # the split record
    assert listing.skipped == {"recordio-no-image": 3}


def test_writer_splits_like_dmlc():
    payload = pack_image(1, JPEG + MAGIC + b"abcd" + MAGIC + b"xy")
    chunks = encode(payload)
    assert chunks.count(MAGIC) == 3  # three chunks, the payload's magics gone
    flags = [struct.unpack_from("<I", chunks, i + 4)[0] >> 29
             for i in range(len(chunks)) if chunks[i : i + 4] == MAGIC]
    assert flags == [1, 2, 3]


def test_bad_files_are_clear_errors(tmp_path: Path):
    make_rec(tmp_path / "t")
    data = (tmp_path / "t.rec").read_bytes()
    scanner = recordio.RecordScanner()
    scanner.feed(data[:-3])
    with pytest.raises(recordio.RecordIOError, match="cut short"):
        scanner.finish()
    with pytest.raises(recordio.RecordIOError, match="bad magic"):
        recordio.RecordScanner().feed(b"not a record file")
    with pytest.raises(recordio.RecordIOError, match="key<TAB>offset"):
        recordio.parse_idx(b"0\t0\nnonsense\n")


def test_labels_padded_to_the_widest(tmp_path: Path):
    base = tmp_path / "w"
    with RecWriter(base.with_suffix(".rec"), base.with_suffix(".idx")) as w:
        for key, label in enumerate((0, 7, 103, 2.5, -1)):
            w.write(key, pack_image(label, JPEG + bytes(10)))
    names = sorted(m.path.decode() for m in records_of(base.with_suffix(".rec"), True).members)
    assert names == ["-1/4.jpg", "000/0.jpg", "007/1.jpg", "103/2.jpg", "2.5/3.jpg"]


# -- through real mounts ------------------------------------------------------------------


def check_mount(mnt: Path, expected: dict[str, bytes]) -> None:
    assert loose_files(mnt) == expected
    samples = image_folder(mnt)
    assert len(samples) == len(expected)
    for path, target in samples:  # ImageFolder's class index is the record's label
        assert target == int(path.split("/")[0])


def test_rec_with_idx_over_http_and_file(tmp_path: Path, nginx, mounter: Mounter):
    expected = make_rec(nginx.root / "train", insightface=True)
    for source in (f"{nginx.url}/train.rec", str(nginx.root / "train.rec")):
        nginx.reset_log()
        m = mounter.mount([source], None, None, "--no-warm")
        if source.startswith("http"):
            uris = {r.uri for r in nginx.access_log()}
            assert uris == {"/train.rec", "/train.idx", "/train.rec.shardfs.idx"}
        check_mount(m.mountpoint, expected)
        m.unmount()


def test_rec_without_idx_is_scanned_and_several_recs_merge(tmp_path: Path, mounter: Mounter):
    a = make_rec(tmp_path / "a", seed=1, with_idx=False)
    # The second file's keys continue the first's (as for a train/extra split), so no path
    # is shadowed; its labels are the same classes.
    base = tmp_path / "b"
    b = {}
    with RecWriter(base.with_suffix(".rec"), base.with_suffix(".idx")) as w:
        for key in range(100, 110):
            image = JPEG + os.urandom(500)
            w.write(key, pack_image(key % 12, image))
            b[f"{key % 12:02d}/{key}.jpg"] = image
    m = mounter.mount([str(tmp_path / "a.rec"), str(tmp_path / "b.rec")])
    check_mount(m.mountpoint, {**a, **b})
    assert "no " in m.log() and "a.idx beside it" in m.log()


def test_directory_of_rec_and_idx_files(tmp_path: Path, mounter: Mounter):
    data = tmp_path / "data"
    data.mkdir()
    expected = make_rec(data / "train")
    # `mount data/*`: the .idx named on the command line goes with its .rec
    m = mounter.mount([str(data / "train.rec"), str(data / "train.idx")])
    check_mount(m.mountpoint, expected)
    m2 = mounter.mount([str(data)])
    check_mount(m2.mountpoint, expected)


def test_rec_written_by_mxnet(tmp_path: Path, mounter: Mounter):
    python = os.environ.get("SHARDFS_MXNET_PYTHON")
    if not python or shutil.which(python) is None:
        pytest.skip("set SHARDFS_MXNET_PYTHON to a Python with mxnet to run this")
    script = '''
import struct, sys
from mxnet import recordio
MAGIC = struct.pack("<I", 0xCED7230A)
w = recordio.MXIndexedRecordIO(sys.argv[1] + ".idx", sys.argv[1] + ".rec", "w")
w.write_idx(0, recordio.pack(recordio.IRHeader(0, [5.0, 6.0], 0, 0), b""))
for k in range(1, 25):
    img = b"\\xff\\xd8\\xff" + bytes(range(k * 7 % 256)) * 3
    if k == 4:
        img = b"\\xff\\xd8\\xff\\xe0" + MAGIC + b"abcd" * 3 + MAGIC + b"tail"
    w.write_idx(k, recordio.pack(recordio.IRHeader(0, float(k % 3), k, 0), img))
w.close()
'''
    subprocess.run([python, "-c", script, str(tmp_path / "mx")], check=True,
                   capture_output=True)
    expected = {}
    for k in range(1, 25):
        img = b"\xff\xd8\xff" + bytes(range(k * 7 % 256)) * 3
        if k == 4:
            img = JPEG + MAGIC + b"abcd" * 3 + MAGIC + b"tail"
        expected[f"{k % 3}/{k}.jpg"] = img
    m = mounter.mount([str(tmp_path / "mx.rec")])
    check_mount(m.mountpoint, expected)


def test_zip_and_rec_under_an_s3_prefix(tmp_path: Path, mounter: Mounter):
    from shardfs.devtools.datagen import make_imagefolder
    from tests.moto_fixture import MotoServer
    from tests.test_zip_mount import deflated_zip

    tree = tmp_path / "tree"
    make_imagefolder(tree, classes=2, per_class=6, mean_kb=6, seed=8, split=None)
    deflated_zip(tree, tmp_path / "a.zip")
    expected = {**loose_files(tree), **make_rec(tmp_path / "r")}
    with MotoServer(tmp_path / "moto") as moto:
        s3 = moto.client("s3")
        s3.create_bucket(Bucket="data")
        for name in ("a.zip", "r.rec", "r.idx"):
            s3.upload_file(str(tmp_path / name), "data", f"mixed/{name}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                   AWS_DEFAULT_REGION="us-east-1")
        mnt, cache = mounter.paths()
        result = subprocess.run([*SHARDFS, "mount", "s3://data/mixed/", str(mnt),
                                 "--cache-dir", str(cache), "--s3-endpoint", moto.url],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        m = mounter.adopt(Mount.from_result(result, mnt, cache))
        assert loose_files(m.mountpoint) == expected
        m.unmount()


def test_an_idx_alone_is_a_clear_error(tmp_path: Path, mounter: Mounter):
    make_rec(tmp_path / "t")
    mnt, cache = mounter.paths()
    result = mounter.run(str(tmp_path / "t.idx"), str(mnt), "--cache-dir", str(cache))
    assert result.returncode != 0
    assert "index of a RecordIO file" in result.stderr and "t.rec" in result.stderr


def test_an_idx_that_does_not_match_fails_the_mount_clearly(tmp_path: Path, mounter: Mounter):
    make_rec(tmp_path / "t")
    lines = (tmp_path / "t.idx").read_text().splitlines()
    key, offset = lines[3].split("\t")
    lines[3] = f"{key}\t{int(offset) + 12}"  # inside the record, not at its header
    (tmp_path / "t.idx").write_text("\n".join(lines) + "\n")
    mnt, cache = mounter.paths()
    result = mounter.run(str(tmp_path / "t.rec"), str(mnt), "--cache-dir", str(cache))
    assert result.returncode != 0
    assert "not a usable recordio shard" in result.stderr and "bad magic" in result.stderr
