"""Real FUSE mounts over nginx (HTTP) and file:// shards: bytes, tools, ImageFolder, DataLoader."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from shardfs.devtools.pagecache import drop_pages
from tests.conftest import SHARDFS, Dataset, Mounter, brace, shard_names, stop_foreground


def publish(ds: Dataset, root: Path, sub: str = "data") -> Path:
    """Copy the shards into the web root (only the shards, not their index files)."""
    dest = root / sub
    dest.mkdir(parents=True, exist_ok=True)
    for name in shard_names(ds):
        shutil.copy(ds.shard_dir / name, dest / name)
    return dest


def assert_same_bytes(ds: Dataset, mnt: Path) -> int:
    files = ds.files()
    for rel, data in files.items():
        assert (mnt / rel).read_bytes() == data, rel
    return len(files)


def test_http_mount_serves_every_byte_with_few_requests(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")])
    nginx.reset_log()  # count only what the reads cause, not indexing
    n = assert_same_bytes(dataset, m.mountpoint)
    records = nginx.access_log()
    shards = len(dataset.shards.shards)
    # Indexing streamed every shard into the cache: reading the files costs no requests.
    assert len(records) <= shards, [r.uri for r in records]
    stats = m.stats()
    assert stats["files"] == n
    assert stats["bytes_served"] == sum(len(b) for b in dataset.files().values())


def test_http_mount_without_warm_fetches_whole_shards(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    # A fetch slot for every shard, so that none is read member by member waiting for one.
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--max-fetches", "64")
    nginx.reset_log()
    files = list(dataset.files().items())
    random.Random(0).shuffle(files)
    for rel, data in files:
        assert (m.mountpoint / rel).read_bytes() == data
    records = [r for r in nginx.access_log() if r.uri.endswith(".tar")]
    shards = len(dataset.shards.shards)
    # Requests on the order of the number of shards, not of the number of files (120).
    assert len(records) <= 4 * shards, len(records)
    stats = m.stats()
    # The dataset fits the cache: every shard is downloaded whole, exactly once.
    assert stats["reader"]["shard_fetches_done"] == shards, stats["reader"]
    fetched = sum(r.bytes_sent for r in records)
    assert fetched <= 2 * sum(s.size for s in dataset.shards.shards)


def test_remount_reuses_index_and_cache(dataset, nginx, mounter: Mounter, tmp_path: Path):
    publish(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")
    cache = tmp_path / "shared-cache"
    m1 = mounter.mount([source], None, cache)
    assert_same_bytes(dataset, m1.mountpoint)
    m1.unmount()
    nginx.reset_log()
    m2 = mounter.mount([source], None, cache)
    assert_same_bytes(dataset, m2.mountpoint)
    records = nginx.access_log()
    # One ranged probe per shard (identity check), no downloads at all.
    assert len(records) == len(dataset.shards.shards)
    assert all(r.range == "bytes=0-0" for r in records)


def test_published_index_files_avoid_scanning(dataset, nginx, mounter: Mounter, tmp_path):
    dest = publish(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")
    out = tmp_path / "idx"
    result = subprocess.run([*mounter_cmd(), "index", source, "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for idx in out.iterdir():
        shutil.copy(idx, dest / idx.name)
    nginx.reset_log()
    m = mounter.mount([source], None, None, "--no-warm")
    records = nginx.access_log()
    tar_bodies = [r for r in records if r.uri.endswith(".tar") and r.range != "bytes=0-0"]
    assert tar_bodies == [], "the mount must not stream shards that have an index"
    assert sum(r.uri.endswith(".shardfs.idx") for r in records) == len(dataset.shards.shards)
    assert_same_bytes(dataset, m.mountpoint)


def mounter_cmd() -> list[str]:
    from tests.conftest import SHARDFS

    return SHARDFS


def test_file_mount_posix_tools(dataset, mounter: Mounter, tmp_path: Path):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    mnt = m.mountpoint
    # ls -la, find, du, sha256sum, cp -r behave like on the original tree.
    ls = subprocess.run(["ls", "-la", str(mnt / "train")], capture_output=True, text=True)
    assert ls.returncode == 0 and "n00000000" in ls.stdout
    found = subprocess.run(["find", str(mnt), "-type", "f"], capture_output=True, text=True)
    assert len(found.stdout.split()) == len(dataset.files())
    du = subprocess.run(["du", "-sb", str(mnt)], capture_output=True, text=True)
    assert du.returncode == 0
    some = sorted(dataset.files())[:5]
    sums = subprocess.run(["sha256sum", *[str(mnt / r) for r in some]],
                          capture_output=True, text=True, check=True).stdout.split("\n")
    for rel, line in zip(some, sums, strict=False):
        assert line.split()[0] == hashlib.sha256((dataset.root / rel).read_bytes()).hexdigest()
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(mnt), str(copy)], check=True)
    for rel, data in dataset.files().items():
        assert (copy / rel).read_bytes() == data
    # stat sizes and mtimes from the headers
    rel = some[0]
    assert os.stat(mnt / rel).st_size == (dataset.root / rel).stat().st_size
    assert os.stat(mnt / rel).st_mtime == 1577836800  # pack's fixed mtime
    # reads at any offset and size
    data = (dataset.root / rel).read_bytes()
    fd = os.open(mnt / rel, os.O_RDONLY)
    try:
        rng = random.Random(1)
        for _ in range(200):
            off = rng.randrange(0, len(data) + 10)
            size = rng.randrange(0, 70000)
            assert os.pread(fd, size, off) == data[off : off + size]
    finally:
        os.close(fd)
    # read-only everywhere
    for attempt in (
        lambda: os.open(mnt / "new", os.O_WRONLY | os.O_CREAT),
        lambda: os.open(mnt / rel, os.O_RDWR),
        lambda: os.mkdir(mnt / "d"),
        lambda: os.unlink(mnt / rel),
        lambda: os.rename(mnt / rel, mnt / "x"),
        lambda: os.chmod(mnt / rel, 0o777),
        lambda: os.setxattr(mnt / rel, "user.x", b"1"),
    ):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    st = os.statvfs(mnt)
    assert st.f_files >= len(dataset.files())
    # xattrs name the shard holding a file
    shard = os.getxattr(mnt / rel, "user.shardfs.shard").decode()
    offset = int(os.getxattr(mnt / rel, "user.shardfs.offset"))
    size = int(os.getxattr(mnt / rel, "user.shardfs.size"))
    with open(shard.removeprefix("file://"), "rb") as f:
        f.seek(offset)
        assert f.read(size) == data
    # nothing extra at the root (ImageFolder would take it for a class)
    assert os.listdir(mnt) == ["train"]


def test_small_cache_evicts_and_stays_within_budget(dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    shard_size = max(s.size for s in dataset.shards.shards)
    # Room for the working set (the last 32 reads span up to 4 shards), not for the dataset.
    budget = 5 * shard_size + 1
    assert budget < sum(s.size for s in dataset.shards.shards)
    # One process: with FUSE worker processes the kernel spreads this one reader's READs over
    # them, each a stream of its own in the working set, and how their windows line up moved
    # the whole shards fetched between 5 and 18 of 20 (session 19; 5 fails below). With one
    # process, 17-20.
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None,
                      "--no-warm", "--cache-size", str(budget), "--max-fetches", "1",
                      "--workers", "1")
    files = dataset.files()
    # Shard by shard (a locality-preserving order): the working set stays within the budget,
    # so whole shards stream through the cache and older ones must be evicted.
    order = sorted(files, key=lambda rel: (os.getxattr(m.mountpoint / rel, "user.shardfs.shard"),
                                           int(os.getxattr(m.mountpoint / rel,
                                                           "user.shardfs.offset"))))
    # Two passes, up to four: on a loaded machine the reads' windows span more shards than fit
    # more often and more shards come as members (a CI run: 5 whole shards in two passes; this
    # test's count under a busy core, before and after session 31: 9-20 of 20).
    for passes in range(1, 5):
        for rel in order:
            assert (m.mountpoint / rel).read_bytes() == files[rel], rel
        for rel in order:  # the next pass must reach the daemon, not the page cache
            drop_pages(m.mountpoint / rel)
        deadline = time.monotonic() + 30
        while m.stats()["shards_fetching"] and time.monotonic() < deadline:
            time.sleep(0.05)  # a read returns once its bytes are in; its fetch ends a bit later
        if passes >= 2 and m.stats()["reader"]["shard_fetches_done"] > 5:
            break
    stats = m.stats()
    # More whole shards than fit went through the cache, and each one past the room for 5 made
    # room by evicting one. Not every shard need come whole: when the streams' windows
    # (workingset.py) briefly span more shards than fit, the reader reads members instead
    # (seen in CI, session 8: 7 and 9 of 10 shards whole).
    done = stats["reader"]["shard_fetches_done"]
    assert done > 5, stats["reader"]
    assert stats["evictions"] >= done - 5, stats
    assert stats["evicted_bytes"] > 0
    assert stats["cache_used_bytes"] <= budget
    assert stats["cache_budget_bytes"] == budget
    cached = sum(f.stat().st_size for f in (m.cache_dir / "shards").iterdir())
    assert cached <= budget


def test_later_shard_wins_duplicate_paths(tmp_path: Path, mounter: Mounter):
    import io
    import tarfile

    for i, content in enumerate([b"old", b"new"]):
        with tarfile.open(tmp_path / f"d-{i}.tar", "w") as tf:
            for name, data in (("same.txt", content), (f"only{i}.txt", b"x")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    m = mounter.mount([str(tmp_path / "d-{0..1}.tar")])
    assert (m.mountpoint / "same.txt").read_bytes() == b"new"
    assert sorted(os.listdir(m.mountpoint)) == ["only0.txt", "only1.txt", "same.txt"]
    assert "1 paths appear in more than one shard" in m.stderr + m.log()


@pytest.mark.parametrize("in_place", ["off", None], ids=["copied", "default"])
def test_a_local_shard_whose_name_is_not_utf8_mounts(tmp_path: Path, mounter: Mounter,
                                                    in_place: str | None):
    """A shard file named by bytes that are not UTF-8 (Latin-1 `é`), with no index beside it:
    scanned, mounted and read as a plain path and as a percent-encoded file:// URL, copied
    and read in place. (The scan once decoded the URL as UTF-8: "No such file".)"""
    import io
    import tarfile

    here = tmp_path / "shards"
    here.mkdir()
    shard = os.fsencode(here) + b"/caf\xe9.tar"
    with tarfile.open(os.fsdecode(shard), "w") as tf:
        info = tarfile.TarInfo("a/x.txt")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"hello"))
    for source in (os.fsdecode(shard), Path(os.fsdecode(shard)).as_uri()):
        m = mounter.mount([source], None, None, in_place=in_place)
        assert (m.mountpoint / "a" / "x.txt").read_bytes() == b"hello", source
        assert m.stats()["shards_in_place"] == (0 if in_place == "off" else 1)
        m.unmount()
    # `shardfs index` names the index file as the catalog looks for it: beside the shard.
    done = subprocess.run([*SHARDFS, "index", os.fsdecode(shard), "-o", str(here)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(os.fsencode(here))) == [b"caf\xe9.tar", b"caf\xe9.tar.shardfs.idx"]


def test_foreground_mount_unmounts_on_sigterm(dataset, tmp_path: Path):
    import signal
    import sys
    import time

    mnt = tmp_path / "fg"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "shardfs", "mount",
                             brace(dataset, str(dataset.shard_dir)), str(mnt), "-f",
                             "--cache-dir", str(tmp_path / "c")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert os.listdir(mnt) == ["train"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not os.path.ismount(mnt)
    finally:
        stop_foreground(proc, mnt)


def test_stale_or_damaged_published_index_is_ignored_and_the_shard_scanned(
        dataset, nginx, mounter: Mounter):
    """README, "Index files": a published index is used only if it is valid for that shard
    (same size, intact checksum); otherwise the shard is scanned."""
    dest = publish(dataset, nginx.root)
    names = shard_names(dataset)
    for name in names:
        shutil.copy(dataset.shard_dir / f"{name}.shardfs.idx", dest / f"{name}.shardfs.idx")
    stale = dest / f"{names[0]}.shardfs.idx"  # an index of an older, larger version
    head, _, body = stale.read_bytes().partition(b"\n")
    header = json.loads(head)
    header["size"] += 512
    stale.write_bytes(json.dumps(header).encode() + b"\n" + body)
    damaged = dest / f"{names[1]}.shardfs.idx"  # one flipped byte in a member line
    raw = bytearray(damaged.read_bytes())
    raw[raw.index(b"\n") + 3] ^= 0x01
    damaged.write_bytes(bytes(raw))
    nginx.reset_log()
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
    scanned = sorted({r.uri.rsplit("/", 1)[1] for r in nginx.access_log()
                      if r.uri.endswith(".tar") and r.range != "bytes=0-0"})
    assert scanned == sorted(names[:2]), scanned
    log = m.log()  # mount-time lines reach the log file too (and the terminal: m.stderr)
    assert log.count("scanning the shard instead") == 2, log
    assert "index is for a shard of" in log and "checksum mismatch" in log
    assert_same_bytes(dataset, m.mountpoint)
    assert sorted(p.relative_to(m.mountpoint).as_posix()
                  for p in m.mountpoint.rglob("*") if p.is_file()) == sorted(dataset.files())


def _parse_members_page(value: bytes) -> dict[str, str]:
    """docs: `user.shardfs.members.N` = a JSON list of shard URLs, then INDEX\\tNAME lines."""
    head, _, body = value.partition(b"\n")
    urls = json.loads(head)
    return {name.decode(): urls[int(index)]
            for index, _, name in (line.partition(b"\t") for line in body.split(b"\n"))}


def test_members_xattr_spans_several_pages_through_the_mount(tmp_path: Path, mounter: Mounter):
    """A directory whose file list exceeds one xattr value (64 KiB) gets several
    `user.shardfs.members.N` pages; together they list every file with its shard."""
    import io
    import tarfile

    expected: dict[str, str] = {}
    for s in range(2):
        path = tmp_path / f"many-{s}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(450):
                name = f"sample-{s}-{i:05d}-" + "n" * 90 + ".cls"
                info = tarfile.TarInfo(f"cls/{name}")
                info.size = 1
                tf.addfile(info, io.BytesIO(b"x"))
                expected[name] = f"file://{path}"
    m = mounter.mount([str(tmp_path / "many-{0..1}.tar")])
    directory = m.mountpoint / "cls"
    pages = sorted(n for n in os.listxattr(directory) if n.startswith("user.shardfs.members."))
    assert len(pages) >= 2, pages  # 900 names of ~110 bytes: more than one 60 kB page
    assert pages == [f"user.shardfs.members.{i}" for i in range(len(pages))]
    seen: dict[str, str] = {}
    for page in pages:
        value = os.getxattr(directory, page)
        assert len(value) <= 65536
        part = _parse_members_page(value)
        assert not set(part) & set(seen)  # each file on exactly one page
        seen.update(part)
    assert seen == expected
    with pytest.raises(OSError) as info:
        os.getxattr(directory, f"user.shardfs.members.{len(pages)}")
    assert info.value.errno == errno.ENODATA
