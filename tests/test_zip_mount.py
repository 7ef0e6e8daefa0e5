"""Zip shards through real mounts: file:// and nginx over HTTP, stored and compressed members,
next to tar shards, published indexes, a bad CRC, other tools' zips; ImageFolder's view equal
to the loose tree's."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardfs.devtools.datagen import make_imagefolder
from tests.conftest import SHARDFS, Mounter
from tests.zipkit import central_entries, set_central, write_zip

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def image_folder(root: Path) -> list[tuple[str, int]]:
    """(path, class index) of every sample, by torchvision ImageFolder's rules (find_classes:
    sorted directories of the root; make_dataset: sorted os.walk, extension test)."""
    try:
        from torchvision.datasets import ImageFolder
    except ImportError:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        samples = []
        for target, name in enumerate(classes):
            for dirpath, _, files in sorted(os.walk(root / name, followlinks=True)):
                for f in sorted(files):
                    if f.lower().endswith(IMG_EXTENSIONS):
                        samples.append((str(Path(dirpath, f).relative_to(root)), target))
        return samples
    ds = ImageFolder(str(root), loader=lambda p: p)
    return [(str(Path(p).relative_to(root)), t) for p, t in ds.samples]


def loose_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_tree_equal(mnt: Path, files: dict[str, bytes]) -> None:
    assert loose_files(mnt) == files


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zips") / "tree"
    make_imagefolder(root, classes=4, per_class=15, mean_kb=8, seed=5, split=None)
    return root


@pytest.fixture(scope="module")
def large_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files far larger than the gaps indexing reads through (catalog/archives.py GAP)."""
    root = tmp_path_factory.mktemp("zips") / "large"
    make_imagefolder(root, classes=3, per_class=4, mean_kb=200, seed=6, split=None)
    return root


def pack_zip(tree: Path, out: Path, shard_size: str) -> list[Path]:
    result = subprocess.run([*SHARDFS, "pack", "--format", "zip", "--shard-size", shard_size,
                             str(tree), str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    shards = sorted(out.glob("*.zip"))
    assert len(shards) >= 3
    return shards


def deflated_zip(tree: Path, path: Path) -> Path:
    """The loose tree in one zip, alternately deflated and stored (as Python's zipfile)."""
    files = loose_files(tree)
    return write_zip(path, files, methods=(zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED))


def test_packed_zips_over_http_ranged_indexing(large_files: Path, tmp_path: Path, nginx,
                                               mounter: Mounter):
    tree = large_files
    shards = pack_zip(tree, tmp_path / "packed", "1MiB")
    data = nginx.root / "data"
    data.mkdir()
    for shard in shards:  # the shards only: the index is built from the zips themselves
        shutil.copy(shard, data / shard.name)
    n = len(shards)
    m = mounter.mount([f"{nginx.url}/data/shard-{{000000..{n - 1:06d}}}.zip"], None, None,
                      "--no-warm")
    records = [r for r in nginx.access_log() if r.uri.endswith(".zip")]
    # Indexing read the end records, central directories and local headers by ranges: a
    # small fraction of the bytes (the stat of each shard costs one byte).
    total = sum(s.stat().st_size for s in shards)
    assert all(r.range for r in records)
    assert sum(r.bytes_sent for r in records) < total / 4
    assert_tree_equal(m.mountpoint, loose_files(tree))
    assert image_folder(m.mountpoint) == image_folder(tree)
    assert m.stats()["files"] == len(loose_files(tree))


def test_small_packed_zips_over_file(tree: Path, tmp_path: Path, mounter: Mounter):
    shards = pack_zip(tree, tmp_path / "packed", "96KiB")
    m = mounter.mount([str(tmp_path / "packed")])  # a directory: its shards, not .shardfs.idx
    assert_tree_equal(m.mountpoint, loose_files(tree))
    assert image_folder(m.mountpoint) == image_folder(tree)
    assert len(shards) >= 4


def test_deflated_zip_beside_a_tar_over_file_and_http(tree: Path, tmp_path: Path, nginx,
                                                      mounter: Mounter):
    # Half the classes in a zip (deflated and stored members), half in a tar shard.
    classes = sorted(p.name for p in tree.iterdir())
    zip_part, tar_part = tmp_path / "zpart", tmp_path / "tpart"
    for name in classes[:2]:
        shutil.copytree(tree / name, zip_part / name)
    for name in classes[2:]:
        shutil.copytree(tree / name, tar_part / name)
    deflated_zip(zip_part, nginx.root / "a.zip")
    result = subprocess.run([*SHARDFS, "pack", str(tar_part), str(tmp_path / "tars")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    tar = next((tmp_path / "tars").glob("*.tar"))
    shutil.copy(tar, nginx.root / "b.tar")
    expected = loose_files(tree)
    for sources in ([f"{nginx.url}/a.zip", f"{nginx.url}/b.tar"],
                    [(nginx.root / "a.zip").as_uri(), str(nginx.root / "b.tar")]):
        m = mounter.mount(sources)
        files = list(expected)
        random.Random(1).shuffle(files)
        # Concurrent readers: the kernel's pieces of one compressed member share one decode.
        mnt = m.mountpoint
        with ThreadPoolExecutor(8) as pool:
            got = dict(zip(files, pool.map(lambda f, mnt=mnt: (mnt / f).read_bytes(), files),
                           strict=True))
        assert got == expected
        assert image_folder(m.mountpoint) == image_folder(tree)
        with zipfile.ZipFile(nginx.root / "a.zip") as z:
            info = next(i for i in z.infolist() if i.compress_type == zipfile.ZIP_DEFLATED)
        member = m.mountpoint / info.filename
        assert os.getxattr(member, "user.shardfs.codec") == b"deflate"
        assert int(os.getxattr(member, "user.shardfs.stored")) == info.compress_size
        assert int(os.getxattr(member, "user.shardfs.size")) == info.file_size
        m.unmount()
    # Again with both shards complete in the cache: reads the C shim answers from the cache
    # file must not include compressed members' stored bytes.
    m2 = mounter.mount(sources)
    subprocess.run([*SHARDFS, "warm", str(m2.mountpoint)], check=True, capture_output=True,
                   timeout=60)
    assert m2.stats()["shards_cached"] == 2
    assert loose_files(m2.mountpoint) == expected


def test_bad_crc_reads_as_eio_and_nothing_else_is_affected(tree: Path, tmp_path: Path,
                                                           mounter: Mounter):
    path = deflated_zip(tree, tmp_path / "crc.zip")
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    victim = next(i for i in infos if i.compress_type == zipfile.ZIP_DEFLATED)
    set_central(path, central_entries(path)[infos.index(victim)], "crc", victim.CRC ^ 1)
    m = mounter.mount([path.as_uri()], None, None, "--workers", "1")
    with pytest.raises(OSError) as err:
        (m.mountpoint / victim.filename).read_bytes()
    assert err.value.errno == errno.EIO
    expected = loose_files(tree)
    del expected[victim.filename]
    for name, data in expected.items():
        assert (m.mountpoint / name).read_bytes() == data
    assert "CRC-32 mismatch" in m.log()


def test_published_index_skips_the_ranged_reads(tree: Path, tmp_path: Path, nginx,
                                                mounter: Mounter):
    deflated_zip(tree, nginx.root / "t.zip")
    out = tmp_path / "idx"
    result = subprocess.run([*SHARDFS, "index", f"{nginx.url}/t.zip", "-o", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    idx = out / "t.zip.shardfs.idx"
    assert idx.read_bytes().startswith(b"{") and b'"shardfs-index/3"' in idx.read_bytes()
    shutil.copy(idx, nginx.root / idx.name)
    nginx.reset_log()
    m = mounter.mount([f"{nginx.url}/t.zip"], None, None, "--no-warm")
    zip_reads = [r for r in nginx.access_log() if r.uri.endswith(".zip")]
    assert [r.range for r in zip_reads] == ["bytes=0-0"]  # the stat; no tail, no headers
    assert_tree_equal(m.mountpoint, loose_files(tree))


def test_info_zip_archive_with_utf8_names(tmp_path: Path, mounter: Mounter):
    if shutil.which("zip") is None:
        pytest.skip("Info-ZIP zip not installed (Debian: zip)")
    src = tmp_path / "src"
    files = {"caf\u00e9/\u65e5\u672c.jpg": b"\xff\xd8\xff" + os.urandom(3000),
             "plain/a.jpg": b"\xff\xd8\xff" + bytes(5000), "plain/b.txt": b"text " * 300}
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    out = tmp_path / "info.zip"
    subprocess.run(["zip", "-qr", str(out), "."], cwd=src, check=True)
    m = mounter.mount([out.as_uri()])
    assert_tree_equal(m.mountpoint, files)


def test_not_a_zip_fails_the_mount_clearly(tmp_path: Path, mounter: Mounter):
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip at all" * 10)
    mnt, cache = mounter.paths()
    result = mounter.run(bad.as_uri(), str(mnt), "--cache-dir", str(cache))
    assert result.returncode != 0
    assert "not a usable zip shard" in result.stderr and "end of central directory" in \
        result.stderr


def _zip64_mount(tmp_path: Path, mounter: Mounter):
    from tests.zipkit import write_zip64_sparse

    path = tmp_path / "z64.zip"
    write_zip64_sparse(path, (4 << 30) + 4096, b"the member past 4 GiB")
    # A cache smaller than the shard: reads are member/block reads, nothing copies 4 GiB.
    return mounter.mount([path.as_uri()], None, None, "--cache-size", "1GiB")


def test_zip64_member_past_4gib_through_a_mount(tmp_path: Path, mounter: Mounter):
    m = _zip64_mount(tmp_path, mounter)
    assert (m.mountpoint / "tail.bin").read_bytes() == b"the member past 4 GiB"
    big = m.mountpoint / "big.bin"
    assert big.stat().st_size == (4 << 30) + 4096
    with open(big, "rb") as f:
        f.seek((4 << 30) - 10)
        assert f.read() == bytes(4096 + 10)


@pytest.mark.slow
def test_zip64_whole_4gib_member_through_a_mount(tmp_path: Path, mounter: Mounter):
    """Reads all of the 4 GiB member (zeros from a hole) through the mount: slow."""
    m = _zip64_mount(tmp_path, mounter)
    zero = bytes(1 << 20)
    with open(m.mountpoint / "big.bin", "rb") as f:
        total = 0
        while block := f.read(1 << 20):
            assert block == zero[: len(block)]
            total += len(block)
    assert total == (4 << 30) + 4096


def test_zips_of_four_writers_in_one_tree_over_http_and_file(tree: Path, tmp_path: Path,
                                                              nginx, mounter: Mounter):
    """Info-ZIP, bsdtar, 7-Zip and Python's zipfile (streamed: data descriptors), one class
    each, mounted together: the same files and ImageFolder as the loose tree."""
    from tests.zipkit import write_streamed_zip

    seven = shutil.which("7zz") or shutil.which("7z")
    if not (shutil.which("zip") and shutil.which("bsdtar") and seven):
        pytest.skip("needs zip, bsdtar and 7-Zip (Debian: zip, libarchive-tools, 7zip)")
    classes = sorted(p.name for p in tree.iterdir())
    commands = ([["zip", "-qr"], ["bsdtar", "--format", "zip", "-cf"],
                 [seven, "a", "-tzip", "-bd", "-bso0"]])
    names = []
    for i, (name, cmd) in enumerate(zip(classes[:3], commands, strict=True)):
        out = nginx.root / f"part{i}.zip"
        subprocess.run([*cmd, str(out), name], cwd=tree, check=True)
        names.append(out.name)
    files = {k: v for k, v in loose_files(tree).items() if k.startswith(classes[3] + "/")}
    write_streamed_zip(nginx.root / "part3.zip", files)
    names.append("part3.zip")
    for sources in ([f"{nginx.url}/part{{0..3}}.zip"], [str(nginx.root / n) for n in names]):
        m = mounter.mount(sources)
        assert_tree_equal(m.mountpoint, loose_files(tree))
        assert image_folder(m.mountpoint) == image_folder(tree)
        m.unmount()


def test_large_compressed_members_stream(tmp_path: Path, mounter: Mounter):
    """Members over read/packed.py's WHOLE_LIMIT are decoded as a stream: sequential and
    backward reads, a CRC checked at the end, a bomb that declares 4 GiB."""
    from shardfs.read.packed import WHOLE_LIMIT

    r = random.Random(2)
    big = b"".join(r.randbytes(1000) * 40 for _ in range(WHOLE_LIMIT // 40_000 + 200))
    assert len(big) > WHOLE_LIMIT
    path = tmp_path / "large.zip"
    with zipfile.ZipFile(path, "w") as z:
        for name, method in (("big.deflate", zipfile.ZIP_DEFLATED),
                             ("big.lzma", zipfile.ZIP_LZMA),
                             ("badcrc", zipfile.ZIP_DEFLATED), ("bomb", zipfile.ZIP_DEFLATED)):
            z.writestr(name, big if name != "bomb" else bytes(1 << 20), compress_type=method)
    entries = central_entries(path)
    with zipfile.ZipFile(path) as z:
        crc = z.getinfo("badcrc").CRC
    set_central(path, entries[2], "crc", crc ^ 0xFF)
    set_central(path, entries[3], "usize", 0xFFFFFFF0)  # declares 4 GiB, has 1 MiB
    m = mounter.mount([path.as_uri()], None, None, "--workers", "1")
    for name in ("big.deflate", "big.lzma"):
        assert (m.mountpoint / name).read_bytes() == big, name
    with open(m.mountpoint / "big.deflate", "rb", buffering=0) as f:  # back, then forward
        for at in (len(big) - 5000, 1000, WHOLE_LIMIT + 123):
            f.seek(at)
            assert f.read(70_000) == big[at : at + 70_000]
    with pytest.raises(OSError) as err:
        (m.mountpoint / "badcrc").read_bytes()
    assert err.value.errno == errno.EIO
    with open(m.mountpoint / "bomb", "rb") as f, pytest.raises(OSError) as err:
        f.read(2 << 20)
    assert err.value.errno == errno.EIO
    log = m.log()
    assert "CRC-32 mismatch" in log and "deflate data ends after 1048576 bytes" in log


def test_info_zip_symlinks(tmp_path: Path, mounter: Mounter):
    if shutil.which("zip") is None:
        pytest.skip("Info-ZIP zip not installed (Debian: zip)")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "img.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100))
    (src / "a" / "link.jpg").symlink_to("img.jpg")
    (src / "up.jpg").symlink_to("a/img.jpg")
    (src / "escape").symlink_to("../../etc/passwd")
    out = tmp_path / "links.zip"
    subprocess.run(["zip", "-qry", str(out), "."], cwd=src, check=True)
    m = mounter.mount([out.as_uri()])
    assert os.readlink(m.mountpoint / "a" / "link.jpg") == "img.jpg"
    assert (m.mountpoint / "up.jpg").read_bytes() == (src / "a" / "img.jpg").read_bytes()
    assert not os.path.lexists(m.mountpoint / "escape")
    assert m.stats()["members_skipped"] == {"symlink-escapes": 1}


def test_announced_zip_members_come_from_the_lookahead(tree: Path, nginx, mounter: Mounter):
    """Stored and deflated members announced on the Lookahead socket (what
    shardfs.torch.Lookahead sends) are fetched ahead by their stored ranges and read from the
    buffer; the dataset is larger than the cache, so no whole-shard fetches."""
    import json
    import socket

    # JPEGs barely compress; text does (its stored range is far shorter than its size).
    text = {f"text/{i}.txt": b"line %d of a compressible file\n" % i * 3000 for i in range(8)}
    expected = {**loose_files(tree), **text}
    write_zip(nginx.root / "la.zip", expected,
              methods=(zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED))
    m = mounter.mount([f"{nginx.url}/la.zip"], None, None, "--no-warm", "--cache-size",
                      "128KiB")
    address = m.stats()["lookahead_socket"]
    files = list(expected.items())
    random.Random(4).shuffle(files)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect("\0" + address[1:])
        sock.sendall(json.dumps({"paths": [name for name, _ in files]}).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            reply += sock.recv(65536)
        assert json.loads(reply)["accepted"] == len(files)
        for name, data in files:
            assert (m.mountpoint / name).read_bytes() == data
        stats = m.stats()
    la, reader = stats["lookahead"], stats["reader"]
    assert la["hits"] >= 0.8 * len(files), la
    assert reader["shard_fetches_started"] == 0 and reader["eio"] == 0
    fetched = stats["bytes_fetched"] - stats["bytes_indexed"]  # small members: indexing
    assert fetched <= 1.3 * (nginx.root / "la.zip").stat().st_size  # read them all, once
