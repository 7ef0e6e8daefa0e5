"""Hostile and malformed shards (tests/hostile_corpus.py), mounted for real (issue #7).

Each shard is mounted on its own through the CLI (file:// path), and all usable ones together
over HTTP. Never a crash or a hang (every step has a timeout); an unusable shard fails the
whole mount with one error line naming it; otherwise bad members are skipped and counted in
the tree-build log line, and nothing under the mount resolves outside it: every symlink
either dangles, loops, or lands on the mount's own filesystem, under the mountpoint.
"""

from __future__ import annotations

import ast
import os
import re
import stat
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from shardfs.catalog.catalog import scan_local_file
from shardfs.catalog.tar import TarError, TarScanner
from shardfs.devtools.nginx import Nginx
from tests.conftest import Mount, Mounter
from tests.hostile_corpus import Case, build_cases, build_corpus
from tests.reliability import report

CASES = build_cases()
WALK_TIMEOUT_S = 60
PATH_MAX = 4096


# -- without a mount: both scanners agree with the corpus ---------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scanners_agree_with_the_corpus(case: Case, tmp_path: Path) -> None:
    """The streaming scanner (remote shards) and the seeking one (local files) both."""
    path = tmp_path / case.name
    path.write_bytes(case.data)
    for mode in ("stream", "local"):
        try:
            if mode == "stream":
                scanner = TarScanner()
                members = scanner.feed(case.data)
                scanner.finish()
                skipped = dict(scanner.skipped)
            else:
                skipped = scan_local_file(str(path)).skipped
        except TarError as exc:
            assert case.error is not None and case.error in str(exc), (mode, exc)
            continue
        assert case.error is None, f"{mode}: accepted, expected {case.error!r}"
        assert skipped == case.skipped, mode
        if mode == "stream":
            for m in members:
                assert m.offset + m.size <= len(case.data)


# -- walking a mount -------------------------------------------------------------------------


def read_rel(mnt: Path, rel: bytes) -> tuple[bytes, os.stat_result]:
    """Read a file by walking directory fds (works below PATH_MAX, follows no symlink)."""
    parts = rel.split(b"/")
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            st = os.fstat(f)
            chunks = []
            while data := os.read(f, 1 << 20):
                chunks.append(data)
            return b"".join(chunks), st
        finally:
            os.close(f)
    finally:
        os.close(fd)


def walk(mnt: Path) -> tuple[dict[bytes, bytes], int]:
    """Every non-directory under the mount ({relative path: type + NUL + link target}), and
    the number of directories, in one find(1) pass (it copes with trees deeper than
    PATH_MAX; directories print no path, which would be quadratic for a deep chain)."""
    out = subprocess.run(["find", str(mnt), "-mindepth", "1", "(", "-type", "d", "-printf",
                          r"d\0\0\0", ")", "-o", "-printf", r"%y\0%P\0%l\0"],
                         capture_output=True, timeout=WALK_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    fields = out.stdout.split(b"\0")[:-1]
    records = [fields[i : i + 3] for i in range(0, len(fields), 3)]
    entries = {rel: kind + b"\0" + target for kind, rel, target in records if kind != b"d"}
    return entries, sum(kind == b"d" for kind, _, _ in records)


def assert_contained(mnt: Path, entries: dict[bytes, bytes]) -> int:
    """Nothing resolves outside the mount; returns the number of symlinks checked."""
    root = os.fsencode(mnt)
    dev = os.stat(mnt).st_dev
    links = 0
    for rel, kind in entries.items():
        path = root + b"/" + rel
        if len(path) >= PATH_MAX - 256:
            continue  # deep plain files: find reached them under the mount, nothing to follow
        real = os.path.realpath(path)
        assert real == root or real.startswith(root + b"/"), (rel, real)
        if kind.startswith(b"l"):
            links += 1
            try:
                st = os.stat(path)  # follows the link, as any reader would
            except OSError as exc:  # dangling or a loop: harmless
                assert exc.errno in (2, 40), (rel, exc)  # ENOENT, ELOOP
                continue
            assert st.st_dev == dev, f"{rel!r} resolves to another filesystem"
    return links


def check_mount(m: Mount, case: Case | None) -> dict[str, int]:
    """Walk, contain, read every file; compare with the case when given. Returns counts."""
    mnt = m.mountpoint
    entries, ndirs = walk(mnt)
    kinds = Counter(kind[:1] for kind in entries.values())
    assert set(kinds) <= {b"f", b"l"}, f"unexpected file types {kinds}"
    links_checked = assert_contained(mnt, entries)
    files = {rel for rel, kind in entries.items() if kind.startswith(b"f")}
    nbytes = 0
    for rel in files:
        data, st = read_rel(mnt, rel)
        assert len(data) == st.st_size, rel
        assert stat.S_IMODE(st.st_mode) & 0o7222 == 0, f"{rel!r}: mode {st.st_mode:o}"
        if case is not None:
            assert data == case.files.get(rel), rel
        nbytes += len(data)
    if case is not None:
        assert files == set(case.files)
        links = {rel: kind.partition(b"\0")[2] for rel, kind in entries.items()
                 if kind.startswith(b"l")}
        assert links == case.links
        assert ndirs >= case.dirs_at_least
    return {"files": len(files), "bytes": nbytes, "links": links_checked, "dirs": ndirs}


def tree_report(m: Mount) -> dict:
    match = re.search(r"tree built: (\{.*\})", m.stderr + m.log())
    assert match, "no tree-build log line"
    return ast.literal_eval(match.group(1))


# -- one by one -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mount_each_hostile_shard(case: Case, mounter: Mounter, tmp_path: Path) -> None:
    path = tmp_path / case.name
    path.write_bytes(case.data)
    if case.error is not None:
        mnt, cache = mounter.paths()
        result = mounter.run(str(path), str(mnt), "--cache-dir", str(cache), timeout=60)
        assert result.returncode != 0
        assert result.stderr.count("shardfs: error:") == 1, result.stderr
        error = result.stderr[result.stderr.index("shardfs: error:"):]
        assert case.name in error and case.error in error, error
        assert "Traceback" not in result.stderr, result.stderr
        assert not os.path.ismount(mnt)
        return
    m = mounter.mount([str(path)])
    check_mount(m, case)
    assert tree_report(m)["skipped"] == case.skipped
    assert m.stats()["reader"]["eio"] == 0


# -- all usable shards together, over HTTP --------------------------------------------------------


def test_mount_all_usable_hostile_shards_together_over_http(request, mounter: Mounter,
                                                            nginx: Nginx) -> None:
    cases = build_corpus(nginx.root / "corpus")
    usable = [c for c in cases if c.error is None]
    m = mounter.mount([f"{nginx.url}/corpus/{c.name}" for c in usable], None, None,
                      "--timeout", "5", "--deadline", "20")
    counts = check_mount(m, None)
    got = tree_report(m)
    want: Counter[str] = Counter()
    for c in usable:
        want.update(c.skipped)
    assert got["skipped"] == dict(want)
    assert got["shadowed"] > 0  # ok.txt is in many shards: the later one wins
    assert m.stats()["reader"]["eio"] == 0
    report(request, "hostile corpus", shards=len(cases), unusable=len(cases) - len(usable),
           members_skipped=sum(want.values()), files_read=counts["files"],
           bytes_verified=counts["bytes"], symlinks_checked=counts["links"],
           dirs_walked=counts["dirs"], escapes=0, crashes=0)
