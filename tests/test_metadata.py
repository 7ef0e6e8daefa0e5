"""Metadata answered by the shim in C (shardfs/fuse/_shim_meta.c) must be exactly what the
Python handlers (shardfs/fuse/ops.py, the path without the shim) answer: the same tree, mounted
both ways, compared entry by entry (real mounts, real kernel requests)."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
import tarfile
import termios
from pathlib import Path

import pytest

from tests.conftest import Mounter, needs_shim

BIG_DIR = 2500  # entries: several READDIR replies, and lookups deep in a binary search


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", *, mode: int = 0o644,
         mtime: int = 1_600_000_000, kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime, info.linkname = kind, mode, mtime, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("metatree")
    with tarfile.open(root / "meta-0.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "a/b/c/deep.txt", b"deep", mtime=1_700_000_123)
        _add(tar, "a/run.sh", b"#!/bin/sh\n", mode=0o755, mtime=1)
        _add(tar, "a/empty", b"")
        _add(tar, "a/link-rel", kind=tarfile.SYMTYPE, link="run.sh")
        _add(tar, "a/link-dangling", kind=tarfile.SYMTYPE, link="../nowhere/at/all")
        _add(tar, "a/b/explicit", kind=tarfile.DIRTYPE, mode=0o700, mtime=1_234_567_890)
        _add(tar, "odd/caf\u00e9 au lait.jpg", b"x" * 5000)
        _add(tar, "odd/" + "n" * 200 + ".bin", b"y" * 513)
        _add(tar, "odd/-dash", b"z")
        _add(tar, "odd/.hidden", b"h")
    with tarfile.open(root / "meta-1.tar", "w") as tar:
        for i in range(BIG_DIR):
            _add(tar, f"big/{i:05d}.cls", os.urandom(i % 97), mtime=1_650_000_000 + i)
    return [f"file://{root}/meta-{{0..1}}.tar"]


def _snapshot(mnt: Path) -> dict[str, object]:
    """Everything a listing and lstat show, by path (listing order included)."""
    seen: dict[str, object] = {}
    todo = [mnt]
    while todo:
        d = todo.pop()
        names = os.listdir(d)  # readdir order, not sorted
        seen[str(d.relative_to(mnt)) + "/"] = names
        for name in names:
            p = d / name
            st = os.lstat(p)
            seen[str(p.relative_to(mnt))] = (
                st.st_mode, st.st_size, st.st_blocks, st.st_nlink, st.st_uid, st.st_gid,
                st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_blksize,
                os.readlink(p) if stat.S_ISLNK(st.st_mode) else None)
            if stat.S_ISDIR(st.st_mode):
                todo.append(p)
    return seen


def _errors(mnt: Path) -> dict[str, int]:
    """The errno of requests that must fail."""
    out = {}
    for what, call in {
        "missing": lambda: os.lstat(mnt / "a" / "no-such-file"),
        "missing-deep": lambda: os.lstat(mnt / "big" / "99999.cls"),
        "below-a-file": lambda: os.lstat(mnt / "a" / "run.sh" / "x"),
        "list-a-file": lambda: os.listdir(mnt / "a" / "run.sh"),
        "write": lambda: os.open(mnt / "a" / "run.sh", os.O_WRONLY),
    }.items():
        try:
            call()
            out[what] = 0
        except OSError as exc:
            out[what] = exc.errno
    return out


@needs_shim
@pytest.mark.parametrize("listing", ["never", "adaptive", "always", "pushing"])
def test_metadata_in_c_matches_the_python_handlers(shards: list[str], mounter: Mounter,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   listing: str):
    """Also with the READDIRPLUS modes kept for measuring (SHARDFS_READDIRPLUS): then lstat
    after a listing shows the attributes the C READDIRPLUS reply gave the kernel."""
    monkeypatch.setenv("SHARDFS_READDIRPLUS", listing)
    in_c = mounter.mount(shards, None, None, "--no-warm", "--workers", "1")
    assert "metadata in C" in in_c.stderr + in_c.log()
    assert (f"listings: {listing}" in in_c.stderr + in_c.log()) == (listing != "pushing")
    c_tree, c_errors = _snapshot(in_c.mountpoint), _errors(in_c.mountpoint)

    monkeypatch.setenv("SHARDFS_NO_SHIM", "1")  # the daemon inherits it
    monkeypatch.delenv("SHARDFS_READDIRPLUS")
    in_python = mounter.mount(shards, None, None, "--no-warm", "--workers", "1")
    assert "pyfuse3 shim not in effect" in in_python.stderr + in_python.log()
    py_tree, py_errors = _snapshot(in_python.mountpoint), _errors(in_python.mountpoint)

    assert len(c_tree["big/"]) == BIG_DIR
    assert c_tree["big/"] == sorted(c_tree["big/"])  # the tree's name order
    assert c_tree["a/run.sh"][0] == stat.S_IFREG | 0o555  # read-only, exec bits kept
    assert c_tree["a/link-dangling"][10] == "../nowhere/at/all"
    assert c_tree["a/link-dangling"][1] == len("../nowhere/at/all")
    assert c_errors == {"missing": errno.ENOENT, "missing-deep": errno.ENOENT,
                        "below-a-file": errno.ENOTDIR, "list-a-file": errno.ENOTDIR,
                        "write": errno.EROFS}
    assert c_tree == py_tree
    assert c_errors == py_errors


def test_metadata_in_c_is_served_by_every_worker(shards: list[str], mounter: Mounter):
    m = mounter.mount(shards, None, None, "--no-warm", "--workers", "2")
    first = _snapshot(m.mountpoint)
    # Listings are cached by the kernel (cache_readdir); lookups and attributes after the
    # dentries are dropped go to whichever worker reads the request first.
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert _snapshot(m.mountpoint) == first
    assert (m.mountpoint / "a" / "b" / "c" / "deep.txt").read_bytes() == b"deep"


@needs_shim
@pytest.mark.parametrize("workers", ["1", "2"])
def test_pythons_open_is_answered_in_c(shards: list[str], mounter: Mounter, workers: str):
    """Python's open() asks isatty() (TCGETS) of each file it opens with default buffering:
    one FUSE_IOCTL per open, which the kernel never stops sending. The shim answers it
    (ENOTTY, as a local file does) without a trip through pyfuse3's loop, by the daemon alone
    and by each worker (their counts reach the stats)."""
    m = mounter.mount(shards, None, None, "--no-warm", "--workers", workers)
    names = sorted(os.listdir(m.mountpoint / "big"))[:300]
    before = m.stats()["ioctls"]
    for name in names:
        with open(m.mountpoint / "big" / name, "rb") as f:  # default buffering: isatty()
            f.read()
    fd = os.open(m.mountpoint / "a" / "run.sh", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as exc:
            fcntl.ioctl(fd, termios.TCGETS, bytes(64))
        assert exc.value.errno == errno.ENOTTY
    finally:
        os.close(fd)
    assert m.stats()["ioctls"] - before >= len(names) + 1


def _thread_names(pid: int) -> list[str]:
    return [(task / "comm").read_text().strip()
            for task in Path(f"/proc/{pid}/task").iterdir()]


@needs_shim
@pytest.mark.parametrize("workers", ["1", "2"])
def test_reader_thread_answers_in_c_and_hands_over_the_rest(
        shards: list[str], mounter: Mounter, workers: str, monkeypatch: pytest.MonkeyPatch):
    """Each serving process (the daemon, or each worker) reads its requests on the shim's
    reader thread (docs/pyfuse3.md): what C answers (here the LOOKUPs and GETATTRs after the
    dentries are dropped) never reaches pyfuse3's loop; what C cannot answer (STATFS,
    getxattr) is handed to it and answered there. SHARDFS_FUSE_THREAD=0: no such thread,
    the same answers. Listings without inodes (SHARDFS_READDIRPLUS=never: where pages are
    pushed, as here, they would give every file's inode, and no LOOKUP would come)."""
    monkeypatch.delenv("SHARDFS_FUSE_THREAD", raising=False)
    monkeypatch.setenv("SHARDFS_READDIRPLUS", "never")
    m = mounter.mount(shards, None, None, "--no-warm", "--workers", workers)
    stats = m.stats()
    serving = stats["workers"] or [stats["pid"]]
    assert len(serving) == int(workers)
    for pid in serving:
        assert "shardfs-fuse" in _thread_names(pid), pid
    first = _snapshot(m.mountpoint)
    before = m.stats()["fuse_requests"]
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert _snapshot(m.mountpoint) == first
    assert os.statvfs(m.mountpoint).f_bsize > 0  # STATFS: pyfuse3's
    with pytest.raises(OSError):
        os.getxattr(m.mountpoint / "a" / "run.sh", "user.none")  # GETXATTR: pyfuse3's
    after = m.stats()["fuse_requests"]
    assert after["in_c"] - before["in_c"] >= len(first) // 2  # a LOOKUP per path at least
    assert after["to_python"] - before["to_python"] >= 2
    m.unmount()

    monkeypatch.setenv("SHARDFS_FUSE_THREAD", "0")  # the daemon inherits it
    m = mounter.mount(shards, None, None, "--no-warm", "--workers", workers)
    stats = m.stats()
    for pid in stats["workers"] or [stats["pid"]]:
        assert "shardfs-fuse" not in _thread_names(pid), pid
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    assert _snapshot(m.mountpoint) == first
    assert m.stats()["fuse_requests"] == {"in_c": 0, "to_python": 0}
