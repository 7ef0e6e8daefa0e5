"""Shards read in place (`--in-place auto`, the default, or `on`): file:// shards serve reads
from their own files, linked into the cache, nothing copied (shardfs/read/inplace.py)."""

from __future__ import annotations

import contextlib
import errno
import gzip
import importlib.util
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import open_catalog
from shardfs.devtools.nginx import free_port
from shardfs.devtools.pagecache import drop_pages
from shardfs.pack import pack
from shardfs.read.inplace import link_in_place
from shardfs.sources import Sources
from shardfs.util.fstypes import Disk, disk_of
from tests.conftest import SHARDFS, Dataset, Mounter, brace, needs_shim, scrape_metrics
from tests.reliability import wait_until


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def shard_entries(cache_dir: Path) -> dict[str, str | None]:
    """What `shards/` holds: name -> the link's target, or None for a file of bytes."""
    shards = cache_dir / "shards"
    return {e.name: os.readlink(e.path) if e.is_symlink() else None
            for e in os.scandir(shards)}


def test_a_mount_in_place_reads_every_file_from_the_shards_own_files(
        dataset: Dataset, mounter: Mounter) -> None:
    """With two worker processes: they open `shards/KEY` (the link) like a cached shard."""
    shards = sorted(str(s.path) for s in dataset.shards.shards)
    port = free_port()
    m = mounter.mount([Path(p).as_uri() for p in shards], None, None,
                      "--in-place", "on", "--workers", "2",
                      "--metrics-listen", f"127.0.0.1:{port}")
    entries = shard_entries(m.cache_dir)
    assert sorted(entries.values()) == shards  # every shard linked, none copied
    assert read_tree(m.mountpoint) == dataset.files()
    stats = m.stats()
    assert stats["shards_cached"] == stats["shards_in_place"] == len(shards), stats
    assert stats["cache_used_bytes"] == 0 and stats["bytes_fetched"] == 0, stats
    assert stats["reader"]["reads"] > 0 and stats["reader"]["fetch_errors"] == 0, stats
    assert shard_entries(m.cache_dir) == entries  # reading copied nothing
    shown = subprocess.run([*SHARDFS, "stats", str(m.mountpoint)], capture_output=True,
                           text=True, timeout=30)
    assert f"{len(shards)} cached ({len(shards)} in place)" in shown.stdout, shown.stdout
    if importlib.util.find_spec("prometheus_client") is not None:
        metrics = scrape_metrics(port)
        assert metrics["shardfs_shards_in_place"] == len(shards), metrics
        assert metrics["shardfs_cache_used_bytes"] == 0, metrics


def test_a_later_mount_with_in_place_off_copies_and_one_with_it_links_again(
        dataset: Dataset, mounter: Mounter, tmp_path: Path) -> None:
    """The links are the mount's own: a mount of the same cache dir with `--in-place off`
    starts without them and copies what it reads; the option links again."""
    urls = [s.path.as_uri() for s in dataset.shards.shards]
    cache_dir = tmp_path / "cache"
    m = mounter.mount(urls, None, cache_dir, "--in-place", "on")
    linked = shard_entries(cache_dir)
    assert len(linked) == len(urls) and None not in linked.values()
    m.unmount()
    m = mounter.mount(urls, None, cache_dir, in_place="off")
    assert shard_entries(cache_dir) == {}  # no link left: nothing read in place
    assert read_tree(m.mountpoint) == dataset.files()
    assert m.stats()["shards_in_place"] == 0 and m.stats()["bytes_fetched"] > 0
    m.unmount()
    copied = {name for name, target in shard_entries(cache_dir).items() if target is None}
    assert copied and all(not n.endswith(".part") for n in copied)
    m = mounter.mount(urls, None, cache_dir, "--in-place", "on")
    entries = shard_entries(cache_dir)
    # Shards copied already are read from their copies; the others are linked.
    assert {n for n, t in entries.items() if t is None} == copied
    assert len(entries) == len(urls)
    assert m.stats()["shards_in_place"] == len(urls) - len(copied)
    assert read_tree(m.mountpoint) == dataset.files()


def test_top_counts_the_shards_read_in_place(dataset: Dataset, mounter: Mounter) -> None:
    """`shardfs top --json` says how many of the cached shards are read in place."""
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None, in_place=None)
    top = subprocess.run([*SHARDFS, "top", "--json", "--count", "2", "--interval", "0.2",
                          str(m.mountpoint)], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    record = json.loads(top.stdout.splitlines()[-1])["mounts"][0]
    shards = len(dataset.shards.shards)
    assert record["shards"] == record["shards_cached"] == record["shards_in_place"] == shards


def test_only_plain_unchanged_file_shards_are_linked(
        dataset: Dataset, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A compressed shard is decompressed into the cache as before; a shard file changed or
    gone since it was indexed is not linked (its fetch then fails as usual, naming it)."""
    here = tmp_path / "shards"
    here.mkdir()
    plain = [Path(shutil.copy(s.path, here)) for s in dataset.shards.shards[:3]]
    packed = here / "packed.tar.gz"
    packed.write_bytes(gzip.compress(dataset.shards.shards[3].path.read_bytes()))
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    cache.open()

    async def catalog_of() -> object:
        sources = Sources()
        try:
            return await open_catalog([p.as_uri() for p in [*plain, packed]], sources, cache)
        finally:
            await sources.aclose()

    try:
        catalog = trio.run(catalog_of)
        changed, gone = plain[1], plain[2]
        os.utime(changed, ns=(0, 1))  # another mtime: another ETag than the indexed one
        gone.unlink()
        with caplog.at_level(logging.INFO, logger="shardfs.read.inplace"):
            assert link_in_place(catalog, cache) == 1
        assert shard_entries(cache.root) == {catalog.keys[0]: str(plain[0])}
        assert cache.linked_count == 1 and cache.used == 0
        assert f"{changed.as_uri()}: changed since it was indexed" in caplog.text
        assert f"{gone.as_uri()}: not read in place" in caplog.text
        assert "1 of 4 shards read in place" in caplog.text
        # A catalog without a plain file:// shard: said plainly, not "0 of N".
        caplog.clear()
        catalog.shards, catalog.keys = catalog.shards[3:], catalog.keys[3:]
        catalog.data_sizes, catalog.codecs = catalog.data_sizes[3:], catalog.codecs[3:]
        with caplog.at_level(logging.INFO, logger="shardfs.read.inplace"):
            assert link_in_place(catalog, cache) == 0
        assert "none of the 1 shards is a plain file:// shard" in caplog.text
        # ... but only where it was asked for by name: auto (the default) says nothing.
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardfs.read.inplace"):
            assert link_in_place(catalog, cache, local_only=True) == 0
        assert caplog.text == ""
    finally:
        cache.close()


def test_a_shard_file_cut_short_while_mounted_gives_eio_not_a_short_file(
        dataset: Dataset, mounter: Mounter, tmp_path: Path) -> None:
    """In place the mount keeps no copy: a shard file truncated behind its back must not
    serve its members cut short (a reader would take a partial JPEG for the whole one).
    Two worker processes: the workers read shard files themselves."""
    here = tmp_path / "shards"
    shutil.copytree(dataset.shard_dir, here)
    urls = [(here / s.path.name).as_uri() for s in dataset.shards.shards]
    m = mounter.mount(urls, None, None, "--in-place", "on", "--workers", "2")
    expected = dataset.files()
    victim, *others = dataset.shards.shards
    cut = [name for name, *_ in victim.members if name in expected]
    assert cut and others
    with open(here / victim.path.name, "r+b") as f:
        f.truncate(1024)  # the first member's header and 512 of its bytes
    for name in cut:
        with pytest.raises(OSError) as caught:
            (m.mountpoint / name).read_bytes()
        assert caught.value.errno == errno.EIO, name
    # Caught when a process opens the link (the size differs from the index's), or, in a
    # process that opened it before the cut, by the short read (test_diskread.py).
    assert "changed since it was linked" in m.log() or "shorter than its index says" in m.log()
    for shard in others:  # untouched: read whole
        for name, *_ in shard.members:
            if name in expected:
                assert (m.mountpoint / name).read_bytes() == expected[name], name


def test_a_shard_file_replaced_while_mounted_is_never_read_at_the_old_offsets(
        dataset: Dataset, mounter: Mounter, tmp_path: Path) -> None:
    """A new version of a shard renamed over the file read in place (how docs/reliability.md
    says to publish one), of the same size: its members fail with EIO and the log names the
    change; never bytes of the new file at the old index's offsets. The default (auto) on the
    local disk; two worker processes, which open links themselves."""
    here = tmp_path / "shards"
    shutil.copytree(dataset.shard_dir, here)
    urls = [(here / s.path.name).as_uri() for s in dataset.shards.shards]
    m = mounter.mount(urls, None, None, "--workers", "2", in_place=None)
    assert m.stats()["shards_in_place"] == len(urls)
    expected = dataset.files()
    victim, *others = dataset.shards.shards
    names = [name for name, *_ in victim.members if name in expected]
    assert names and others
    path = here / victim.path.name
    old = path.stat()
    new = here / "new-version.tmp"
    new.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
    os.utime(new, ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))
    os.replace(new, path)
    for name in names:
        with pytest.raises(OSError) as caught:
            (m.mountpoint / name).read_bytes()
        assert caught.value.errno == errno.EIO, name
    assert "changed since it was linked" in m.log()
    for shard in others:
        for name, *_ in shard.members:
            if name in expected:
                assert (m.mountpoint / name).read_bytes() == expected[name], name


def test_by_default_shards_on_a_local_disk_are_read_in_place_and_a_network_ones_copied(
        dataset: Dataset, mounter: Mounter, tmpfs: Path, tmp_path: Path) -> None:
    """`--in-place auto`, the default (no option given): shards on a tmpfs (local) are
    linked; the same shards served by a FUSE file system (another shardfs mount, standing in
    for a network file system) are copied, and the log says why."""
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, tmpfs)
    local = mounter.mount([brace(dataset, tmpfs.as_uri())], None, None, in_place=None)
    assert local.stats()["shards_in_place"] == len(dataset.shards.shards)
    assert local.stats()["in_place"] == "auto"
    assert read_tree(local.mountpoint) == dataset.files()
    # The shards as files of an outer shardfs mount (fuse.shardfs).
    outer = pack(tmpfs, tmp_path / "outer", prefix="outer", shard_size=1 << 30)
    served = mounter.mount([s.path.as_uri() for s in outer.shards], None, None)
    assert (served.mountpoint / dataset.shards.shards[0].path.name).is_file()
    remote = mounter.mount([brace(dataset, served.mountpoint.as_uri())], None, None,
                           in_place=None)
    assert remote.stats()["shards_in_place"] == 0
    assert read_tree(remote.mountpoint) == dataset.files()
    assert remote.stats()["bytes_fetched"] > 0
    assert f"{len(dataset.shards.shards)} shards on fuse.shardfs (not a local disk) copied " \
        "into the cache" in remote.log()


def _read_twice_with_no_thread_per_read(m, dataset: Dataset, threads_allowed: int = 0) -> None:
    """Reads every file, drops the mount's pages, reads every file again (now from shard
    files on disk); the mount's disk reads were answered at once (in C, or inline in Python
    without the shim), at most `threads_allowed` in a thread."""
    assert read_tree(m.mountpoint) == dataset.files()
    for path in m.mountpoint.rglob("*"):
        if path.is_file():
            drop_pages(path)
    before = m.stats()["reader"]["reads"]
    assert read_tree(m.mountpoint) == dataset.files()
    assert m.stats()["reader"]["reads"] > before  # the second pass reached the daemon
    answered = "inline" if os.environ.get("SHARDFS_NO_SHIM") else "in_c"
    with contextlib.suppress(AssertionError):  # the counts reach the stats every 10-40 ms
        wait_until(lambda: m.stats()["disk_reads"][answered] > 0, "reads counted", 5)
    reads = m.stats()["disk_reads"]
    assert reads[answered] > 0 and reads["threaded"] <= threads_allowed, reads


@pytest.mark.parametrize("workers", ["1", "2"])
def test_shards_on_a_tmpfs_read_in_place_take_no_thread_per_read(
        dataset: Dataset, mounter: Mounter, tmpfs: Path, workers: str) -> None:
    """tmpfs takes no RWF_NOWAIT (EOPNOTSUPP), with which a read asks whether its bytes are
    in memory: a tmpfs file's always are, so its reads are plain preads, in C with the shim
    (inline in Python without), never a thread per read (300 µs a file on 2 cores, 10x in
    place on ext4: docs/scale.md, "The 16-core machine again")."""
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, tmpfs)
    m = mounter.mount([brace(dataset, tmpfs.as_uri())], None, None, "--in-place", "on",
                      "--workers", workers)
    assert m.stats()["shards_in_place"] == len(dataset.shards.shards)
    _read_twice_with_no_thread_per_read(m, dataset)


@needs_shim
@pytest.mark.parametrize("workers", ["1", "2"])
def test_shards_on_an_overlayfs_read_in_place_take_no_thread_per_read(
        dataset: Dataset, mounter: Mounter, overlay: Path, workers: str) -> None:
    """overlayfs (a container's own file system) takes no RWF_NOWAIT either, and its files
    are on a disk: the shim asks mincore, over a mapping of the shard file, whether a read's
    bytes are in the page cache, and reads them in C when they are (the shards were just
    written, so they are), all but the first read of each shard in each serving process."""
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, overlay)
    m = mounter.mount([brace(dataset, overlay.as_uri())], None, None, "--in-place", "on",
                      "--workers", workers)
    shards = len(dataset.shards.shards)
    assert m.stats()["shards_in_place"] == shards
    # A shard's first read is Python's (it opens the file for C), which asks a thread.
    _read_twice_with_no_thread_per_read(m, dataset, threads_allowed=shards * int(workers))


def test_a_cache_dir_on_a_tmpfs_takes_no_thread_per_read(dataset: Dataset, mounter: Mounter,
                                                         tmpfs: Path) -> None:
    """The same for shards copied into a cache dir on a tmpfs (/dev/shm on a node with the
    memory for it); pages not pushed, so that reads reach the daemon."""
    m = mounter.mount([s.path.as_uri() for s in dataset.shards.shards], None, tmpfs / "cache",
                      "--push-pages", "off")
    _read_twice_with_no_thread_per_read(m, dataset)
    assert m.stats()["bytes_fetched"] > 0


def test_by_default_shards_on_a_spinning_disk_are_copied_to_a_cache_dir_on_a_faster_one(
        dataset: Dataset, loop_disks, mounter: Mounter) -> None:
    """`--in-place auto` and what the kernel tells of the disks (queue/rotational): shards on
    a disk that spins with the cache dir on one that does not are copied (one sequential read
    per shard to the faster disk), and the log says why; with both disks spinning, or
    neither, they are read in place."""
    shard_disk, cache_disk = loop_disks("shards"), loop_disks("cache")
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, shard_disk.path)
    source = brace(dataset, shard_disk.path.as_uri())
    shards = len(dataset.shards.shards)

    shard_disk.set_rotational(True)
    cache_disk.set_rotational(False)
    copied = mounter.mount([source], None, cache_disk.path / "spinning", in_place=None)
    assert copied.stats()["shards_in_place"] == 0
    assert read_tree(copied.mountpoint) == dataset.files()
    assert copied.stats()["bytes_fetched"] > 0
    assert not any(shard_entries(copied.cache_dir).values())  # files of bytes, no links
    assert (f"{shards} shards on a rotational disk ({shard_disk.device}; the cache dir on "
            f"{cache_disk.device}, not rotational) copied into the cache") in copied.log()
    copied.unmount()

    for spins in (True, False):  # the copy would buy nothing: the same kind of disk
        cache_disk.set_rotational(spins)
        shard_disk.set_rotational(spins)
        linked = mounter.mount([source], None, cache_disk.path / f"rotational-{spins}",
                               in_place=None)
        assert linked.stats()["shards_in_place"] == shards, spins
        assert read_tree(linked.mountpoint) == dataset.files()
        assert linked.stats()["bytes_fetched"] == 0
        linked.unmount()


def fake_block_device(sys_root: Path, dev: int, name: str, rotational: bool,
                      model: str | None) -> None:
    """sysfs's entries for a whole disk: /sys/dev/block/MAJ:MIN -> its device dir, with
    queue/rotational and (where given) device/model, as an NVMe namespace's controller or a
    SCSI disk has it."""
    disk = sys_root / "devices" / "pci0" / "block" / name
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "rotational").write_text("1\n" if rotational else "0\n")
    if model is not None:
        (disk / "device").mkdir()
        (disk / "device" / "model").write_text(model.ljust(40) + "\n")  # NVMe pads it
    links = sys_root / "dev" / "block"
    links.mkdir(parents=True, exist_ok=True)
    (links / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(f"../../devices/pci0/block/{name}")


def test_shards_on_a_network_backed_volume_are_copied_to_a_local_disk(tmp_path: Path,
                                                                      tmpfs: Path) -> None:
    """A cloud's network-backed volume reports itself as a disk that does not spin (EBS on
    Nitro is an NVMe device); its `device/model` tells it apart. Shards there, the cache dir on
    the instance's own NVMe: copied (`in_place auto`), as from a spinning disk; both on such
    volumes, or the shards on a local disk: read in place. (The two file systems are the
    test's tmp dir and a tmpfs; the sysfs tree that describes their devices is the test's.)"""
    from shardfs.util.fstypes import ShardStorage

    shards_dev, cache_dev = os.stat(tmp_path).st_dev, os.stat(tmpfs).st_dev
    assert shards_dev != cache_dev
    cases = {  # (shards' disk model, cache dir's disk model): copied?
        ("Amazon Elastic Block Store", "Amazon EC2 NVMe Instance Storage"): "nvme1n1: Amazon",
        ("nvme_card-pd", "nvme_card"): "nvme1n1: nvme_card-pd",
        ("PersistentDisk", "nvme_card"): "nvme1n1: PersistentDisk",
        ("Amazon Elastic Block Store", "Amazon Elastic Block Store"): None,
        ("Amazon EC2 NVMe Instance Storage", "Amazon EC2 NVMe Instance Storage"): None,
        ("Samsung SSD 990 PRO 2TB", "Amazon Elastic Block Store"): None,
    }
    for i, ((shards_model, cache_model), copied) in enumerate(cases.items()):
        sys_root = tmp_path / f"sys{i}"
        fake_block_device(sys_root, shards_dev, "nvme1n1", False, shards_model)
        fake_block_device(sys_root, cache_dev, "nvme2n1", False, cache_model)
        why = ShardStorage(str(tmpfs), str(sys_root)).copied_because(shards_dev)
        if copied is None:
            assert why is None, (shards_model, cache_model, why)
        else:
            assert why is not None and "network-backed volume" in why and copied in why, why
            assert why.endswith("the cache dir on nvme2n1, a local disk)"), why
    # A disk without a model (virtio's, a loop device): as before, by rotational alone.
    sys_root = tmp_path / "sys-plain"
    fake_block_device(sys_root, shards_dev, "vdb", True, None)
    fake_block_device(sys_root, cache_dev, "nvme0n1", False, None)
    assert disk_of(shards_dev, str(sys_root)) == Disk("vdb", True, None)
    assert "on a rotational disk (vdb" in (ShardStorage(str(tmpfs), str(sys_root))
                                          .copied_because(shards_dev) or "")


def test_a_partition_is_told_of_by_its_disk(tmp_path: Path) -> None:
    """sysfs's layout: /sys/dev/block/MAJ:MIN links to the device; a partition (a `partition`
    file, no queue of its own) is answered by its disk's queue/rotational. Device numbers no
    block device backs (tmpfs's, btrfs's) have no entry."""
    disk = tmp_path / "devices" / "pci0" / "block" / "sdb"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "rotational").write_text("1\n")
    (disk / "sdb2").mkdir()
    (disk / "sdb2" / "partition").write_text("2\n")
    links = tmp_path / "dev" / "block"
    links.mkdir(parents=True)
    (links / "8:16").symlink_to("../../devices/pci0/block/sdb")
    (links / "8:18").symlink_to("../../devices/pci0/block/sdb/sdb2")
    assert disk_of(os.makedev(8, 16), str(tmp_path)) == Disk("sdb", True)
    assert disk_of(os.makedev(8, 18), str(tmp_path)) == Disk("sdb2", True)
    assert disk_of(os.makedev(0, 42), str(tmp_path)) is None
    # and this machine's own: the root file system's disk, if a block device backs it
    root = disk_of(os.stat("/").st_dev)
    if root is not None:
        assert Path("/sys/class/block", root.name).exists()


@needs_shim
def test_evicted_shards_on_an_overlayfs_are_unmapped(dataset: Dataset, mounter: Mounter,
                                                     overlay: Path) -> None:
    """The mapping that mincore looks at goes with its shard's descriptor when the shard is
    evicted (fastread.py, `close_stale`): a removed cache file still mapped would keep its
    disk space, as a descriptor would. A cache dir on an overlayfs, room for 5 of 10 shards,
    read shard by shard."""
    shard_size = max(s.size for s in dataset.shards.shards)
    m = mounter.mount([s.path.as_uri() for s in dataset.shards.shards], None,
                      overlay / "cache", "--cache-size", str(5 * shard_size + 1),
                      "--push-pages", "off", "--workers", "1")
    files = dataset.files()
    order = sorted(files, key=lambda rel: (os.getxattr(m.mountpoint / rel, "user.shardfs.shard"),
                                           int(os.getxattr(m.mountpoint / rel,
                                                           "user.shardfs.offset"))))
    for rel in order:
        assert (m.mountpoint / rel).read_bytes() == files[rel], rel
    assert m.stats()["evictions"] > 0, m.stats()

    def shard_maps() -> list[str]:  # the daemon's mappings of shard files (the live ones too)
        with open(f"/proc/{m.pid}/maps") as f:
            return [line for line in f if "/shards/" in line]

    with contextlib.suppress(AssertionError):  # descriptors are closed every 10-40 ms
        wait_until(lambda: not any("(deleted)" in line for line in shard_maps()),
                   "evicted shards unmapped", 5)
    maps = shard_maps()
    assert maps and not any("(deleted)" in line for line in maps), maps
