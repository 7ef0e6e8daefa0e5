"""A new user's first hour (issue #13): logs, first contact, mountpoints, cache budget,
servers without Range support, small messages. Real mounts, real servers, real processes."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.devtools.nginx import free_port
from tests.conftest import SHARDFS, Dataset, Mount, Mounter, brace, shard_names
from tests.test_mount import assert_same_bytes, publish


def shardfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*SHARDFS, *args], capture_output=True, text=True, timeout=timeout)


def failed(mounter: Mounter, result: subprocess.CompletedProcess, mnt: Path,
           cache: Path) -> bool:
    """True if the mount command failed; a mount that wrongly succeeded is still torn down."""
    if result.returncode == 0:
        mounter.adopt(Mount.from_result(result, mnt, cache))
    return result.returncode != 0


# -- 2: one log line per HTTP request ---------------------------------------------------------
def test_no_line_per_request_in_terminal_or_log(dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    mnt, cache = mounter.paths()
    result = mounter.run(brace(dataset, f"{nginx.url}/data"), str(mnt), "--cache-dir",
                         str(cache), "--no-warm")
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert_same_bytes(dataset, m.mountpoint)
    requests = m.stats()["source"]["requests"]
    assert requests > len(shard_names(dataset))
    log = m.log()
    for text in (result.stderr, log):
        assert "HTTP Request" not in text and "httpx" not in text, text
    # 7: mount-time lines reach shardfs.log too, not only the waiting terminal.
    assert "tree built" in log and "ready:" in log


# -- 3: first contact fails fast; retry warnings collapse -------------------------------------
@pytest.mark.parametrize("where", ["refused", "unknown-host"])
def test_first_contact_fails_fast(where: str, mounter: Mounter):
    url = f"http://127.0.0.1:{free_port()}/x-{{0..3}}.tar" if where == "refused" \
        else "http://no-such-host.invalid/x-{0..3}.tar"
    mnt, cache = mounter.paths()
    began = time.monotonic()
    result = mounter.run(url, str(mnt), "--cache-dir", str(cache), "--deadline", "600")
    took = time.monotonic() - began
    assert failed(mounter, result, mnt, cache) and result.returncode == 1
    assert result.stderr.count("shardfs: error:") == 1, result.stderr
    assert "cannot connect to" in result.stderr and "/x-0.tar" in result.stderr, result.stderr
    assert "retrying" not in result.stderr, result.stderr
    assert took < 300, "a refused first contact must not wait for the deadline"
    assert not os.path.ismount(mnt)
    assert not cache.exists(), "a failed mount leaves no empty cache dir behind"


def test_retry_warnings_collapse_per_host(dataset: Dataset, nginx, mounter: Mounter):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm",
                      "--deadline", "4", "--timeout", "0.5")
    rel = sorted(dataset.files())[0]
    nginx.stop()
    with pytest.raises(OSError):
        (m.mountpoint / rel).read_bytes()
    stats = m.stats()["source"]
    assert stats["retries"] >= 4, stats  # backoff 0.1, 0.2, 0.4, ... within 4 s
    warnings = [line for line in m.log().splitlines() if "retrying in" in line]
    assert len(warnings) == 1, warnings  # one per host per 10 s, not one per retry
    nginx.start()
    assert (m.mountpoint / rel).read_bytes() == dataset.files()[rel]  # retries: it answered


# -- 4: mountpoints ---------------------------------------------------------------------------
def test_forgotten_mountpoint_is_named(dataset: Dataset):
    result = shardfs("mount", brace(dataset, str(dataset.shard_dir)))
    assert result.returncode == 1
    assert "no MOUNTPOINT given" in result.stderr, result.stderr


def test_nonempty_mountpoint_refused_unless_asked(dataset: Dataset, mounter: Mounter):
    mnt, cache = mounter.paths()
    (mnt / "precious.txt").write_text("mine")
    source = brace(dataset, str(dataset.shard_dir))
    result = mounter.run(source, str(mnt), "--cache-dir", str(cache))
    assert failed(mounter, result, mnt, cache) and "not empty" in result.stderr, result.stderr
    assert "--nonempty" in result.stderr and not os.path.ismount(mnt)
    for extra in (["--nonempty"], ["-o", "nonempty"]):
        result = mounter.run(source, str(mnt), "--cache-dir", str(cache), *extra)
        m = mounter.adopt(Mount.from_result(result, mnt, cache))
        assert not (mnt / "precious.txt").exists()  # hidden while mounted
        assert_same_bytes(dataset, m.mountpoint)
        assert shardfs("umount", str(mnt)).returncode == 0
        assert (mnt / "precious.txt").read_text() == "mine"


@contextlib.contextmanager
def tmpfs_at(path: Path) -> Iterator[None]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_umount_refuses_what_is_not_shardfs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    other = tmp_path / "tmpfs"
    with tmpfs_at(other):
        result = shardfs("umount", str(other))
        assert result.returncode == 1
        assert "not a shardfs mount" in result.stderr and "tmpfs" in result.stderr
        assert os.path.ismount(other)  # untouched
    plain = tmp_path / "plain"
    plain.mkdir()
    result = shardfs("umount", str(plain))
    assert result.returncode == 1 and "is not mounted" in result.stderr, result.stderr


def test_umount_busy_suggests_lazy(dataset: Dataset, mounter: Mounter):
    m = mounter.mount([brace(dataset, str(dataset.shard_dir))])
    inside = m.mountpoint / "train"
    holder = subprocess.Popen(["sleep", "60"], cwd=inside)  # its working directory is inside
    try:
        result = shardfs("umount", str(m.mountpoint))
        assert result.returncode == 1 and "busy" in result.stderr
        assert "--lazy" in result.stderr, result.stderr
        assert os.path.ismount(m.mountpoint)
        assert shardfs("umount", "--lazy", str(m.mountpoint)).returncode == 0
        assert not os.path.ismount(m.mountpoint)
    finally:
        holder.kill()
        holder.wait()
    # 7: the log says how it ended, not "unmounted from outside".
    deadline = time.monotonic() + 10
    while "unmounted" not in m.log().split("ready:")[-1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "from outside" not in m.log()
    assert "was unmounted (shardfs umount" in m.log()


def test_warm_on_unmounted_dir_names_it(tmp_path: Path):
    plain = tmp_path / "not-mounted"
    plain.mkdir()
    result = shardfs("warm", str(plain))
    assert result.returncode == 1
    assert f"{plain} is not in a shardfs mount" in result.stderr, result.stderr


# -- 5: cache budget --------------------------------------------------------------------------
def test_cache_budget_warnings(dataset: Dataset, mounter: Mounter):
    source = brace(dataset, str(dataset.shard_dir))
    largest = max(s.path.stat().st_size for s in dataset.shards.shards)
    mnt, cache = mounter.paths()
    result = mounter.run(source, str(mnt), "--cache-dir", str(cache), "--cache-size",
                         str(largest // 2))
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert "smaller than the largest shard" in result.stderr, result.stderr
    assert "separate request" in result.stderr
    assert "smaller than the largest shard" in m.log()
    assert shardfs("umount", str(mnt)).returncode == 0
    mnt2, cache2 = mounter.paths()
    result = mounter.run(source, str(mnt2), "--cache-dir", str(cache2), "--cache-size", "900T")
    mounter.adopt(Mount.from_result(result, mnt2, cache2))
    assert re.search(r"--cache-size 900\.0 TiB is more than the disk under .* can hold",
                     result.stderr), result.stderr


# -- 6: servers without Range support ---------------------------------------------------------
@contextlib.contextmanager
def plain_http_server(root: Path) -> Iterator[tuple[str, list[str]]]:
    """Python's http.server (no Range support); yields its URL and the Range headers seen."""
    ranges: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            ranges.append(self.headers.get("Range") or "")
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # shardfs closes the probe's response early

    server = Server(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", ranges
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("warm", [True, False], ids=["warm-while-indexing", "no-warm"])
def test_server_without_range_support_mounts_whole_shard_only(
        warm: bool, tmp_path: Path, mounter: Mounter, dataset: Dataset):
    publish(dataset, tmp_path / "www")
    with plain_http_server(tmp_path / "www") as (url, ranges):
        extra = [] if warm else ["--no-warm"]
        m = mounter.mount([brace(dataset, f"{url}/data")], None, None, *extra)
        assert_same_bytes(dataset, m.mountpoint)
        # A read returns once its bytes are in; its shard is committed (fdatasync) after.
        deadline = time.monotonic() + 30
        while m.stats()["shards_cached"] < len(shard_names(dataset)):
            assert time.monotonic() < deadline, m.stats()
            time.sleep(0.05)
        assert m.stats()["reader"]["member_fetches"] == 0  # no member reads: whole shards only
    log = m.log()
    assert log.count("whole-shard-only mode") == 1, log
    assert all(r in ("", "bytes=0-0") for r in ranges), set(ranges)


def test_whole_only_shard_larger_than_cache_gives_clear_eio(tmp_path: Path, mounter: Mounter,
                                                             dataset: Dataset):
    publish(dataset, tmp_path / "www")
    largest = max(s.path.stat().st_size for s in dataset.shards.shards)
    with plain_http_server(tmp_path / "www") as (url, _):
        m = mounter.mount([brace(dataset, f"{url}/data")], None, None, "--no-warm",
                          "--cache-size", str(largest // 4))
        assert "can only be read whole" in m.stderr
        rel = sorted(dataset.files())[0]
        with pytest.raises(OSError) as info:
            (m.mountpoint / rel).read_bytes()
        assert info.value.errno == 5
    assert "larger --cache-size" in m.log()


# -- 7: small things --------------------------------------------------------------------------
def test_directory_url_gets_a_hint(nginx, mounter: Mounter):
    (nginx.root / "data").mkdir()
    mnt, cache = mounter.paths()
    result = mounter.run(f"{nginx.url}/data/", str(mnt), "--cache-dir", str(cache))
    assert failed(mounter, result, mnt, cache)
    assert "directory listings are not a source" in result.stderr, result.stderr


def test_glob_with_index_files(dataset: Dataset, mounter: Mounter):
    everything = sorted(str(p) for p in dataset.shard_dir.iterdir())  # what `shards/*` gives
    assert any(p.endswith(".shardfs.idx") for p in everything)
    mnt, cache = mounter.paths()
    result = mounter.run(*everything, str(mnt), "--cache-dir", str(cache))
    m = mounter.adopt(Mount.from_result(result, mnt, cache))
    assert_same_bytes(dataset, m.mountpoint)
    lone = next(p for p in everything if p.endswith(".shardfs.idx"))
    mnt2, cache2 = mounter.paths()
    result = mounter.run(lone, str(mnt2), "--cache-dir", str(cache2))
    assert failed(mounter, result, mnt2, cache2)
    assert "is a shardfs index file, not a shard" in result.stderr


def test_pack_names_the_flag(tmp_path: Path, dataset: Dataset):
    out = tmp_path / "out"
    assert shardfs("pack", str(dataset.root), str(out)).returncode == 0
    again = shardfs("pack", str(dataset.root), str(out))
    assert again.returncode != 0
    assert "use --force to replace" in again.stderr and "force=True" not in again.stderr


def test_help_describes_every_argument():
    """Every option and positional of every command says what it is (shardfs CMD --help)."""
    import argparse

    from shardfs.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, sub in commands.choices.items()
               for action in sub._actions
               if action.help is None and not isinstance(action, argparse._HelpAction)]
    assert not missing, f"no help text: {missing}"
    assert "--max-member-fetches" in shardfs("mount", "--help").stdout
