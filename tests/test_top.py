"""`shardfs top` on a real mount during real epochs: the full-screen view in tmux (files/s that
move, `q`, the terminal given back), `--json` lines, a mount that goes away; and the Grafana
dashboard's queries against a real mount's /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.devtools.nginx import free_port
from tests.conftest import SHARDFS, Dataset, Mount, Mounter, brace
from tests.faultproxy import FaultProxy
from tests.test_mount import publish

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "examples" / "grafana" / "shardfs.json"

# Epochs over every file of the mount in a new random order each time, until killed: the
# first one cold (fetched from nginx), the later ones from the page cache.
EPOCHS = """
import os, random, sys, time
root = sys.argv[1]
files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
while True:
    random.shuffle(files)
    for path in files:
        with open(path, "rb") as f:
            f.read()
    time.sleep(random.random() * 0.05)
"""


class Tmux:
    """A tmux server of our own (its own socket), killed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.socket = f"shardfs-top-{os.getpid()}-{time.monotonic_ns()}"
        self.tmp_path = tmp_path

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args],
                              capture_output=True, text=True, check=True, timeout=30).stdout

    def start(self, command: str) -> None:
        self("new-session", "-d", "-s", "t", "-x", "160", "-y", "50", command)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t")

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    if not shutil.which("tmux"):
        pytest.skip("tmux is not installed (apt install tmux)")
    t = Tmux(tmp_path)
    try:
        yield t
    finally:
        t.kill()


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _files_per_s(screen: str, mountpoint: Path) -> int | None:
    match = re.search(r"^\s+read\s+(\d+) files/s", screen, re.M)
    return int(match.group(1)) if match and str(mountpoint) in screen else None


def _top_shell(mountpoint: Path, status: Path) -> str:
    """Run top; afterwards write its exit status and the terminal's settings, then linger so
    the pane can be looked at."""
    top = " ".join([*SHARDFS, "top", str(mountpoint)])
    return f"cd {REPO} && {top}; echo EXIT=$? > {status}; stty -a >> {status}; sleep 60"


def test_top_during_epochs_quits_on_q_streams_json_and_shows_a_gone_mount(
        dataset: Dataset, nginx, mounter: Mounter, tmux: Tmux, tmp_path: Path):
    publish(dataset, nginx.root)
    m = mounter.mount([brace(dataset, f"{nginx.url}/data")], None, None, "--no-warm")
    reader = subprocess.Popen([sys.executable, "-c", EPOCHS, str(m.mountpoint)])
    try:
        # The full-screen view: files/s non-zero and moving between refreshes.
        status = tmp_path / "status"
        tmux.start(_top_shell(m.mountpoint, status))
        seen: list[int] = []

        def moving() -> bool:
            value = _files_per_s(tmux.screen(), m.mountpoint)
            if value is not None and (not seen or value != seen[-1]):
                seen.append(value)
            return len([v for v in seen if v > 0]) >= 3

        _wait_for(moving, 30, f"files/s to change on the screen (saw {seen})")
        screen = tmux.screen()
        assert "shardfs top" in screen and "q quits" in screen, screen
        assert "oldest" in screen and "hit ratio" in screen and "daemon" in screen, screen
        tmux("send-keys", "-t", "t", "q")
        _wait_for(lambda: status.exists() and "EXIT=" in status.read_text(), 10, "top to exit")
        after = status.read_text()
        assert after.startswith("EXIT=0"), after
        # The terminal is given back: echo and line editing on again, the view gone.
        assert re.search(r"(?<!-)\becho\b", after) and re.search(r"(?<!-)\bicanon\b", after), \
            after
        assert "q quits" not in tmux.screen()
        tmux.kill()

        # --json: one parseable object per refresh, with the mount's rates.
        result = subprocess.run([*SHARDFS, "top", "--json", "--count", "3", "--interval",
                                 "0.5", str(m.mountpoint)], capture_output=True, text=True,
                                timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(lines) == 3
        mounts = [rec["mounts"][0] for rec in lines]
        assert all(r["mountpoint"] == str(m.mountpoint) and r["state"] == "ok" for r in mounts)
        assert any((r.get("files_per_s") or 0) > 0 for r in mounts[1:]), mounts
        assert {"read_bps", "page_cache_bps", "daemon_bps", "fetch_bps", "reads_waiting",
                "oldest_wait_s", "cpu_daemon", "hit_ratio"} <= set(mounts[-1]), mounts[-1]

        # A mount that goes away while watched is shown as gone, and top goes on.
        tmux.start(_top_shell(m.mountpoint, status := tmp_path / "status2"))
        _wait_for(lambda: _files_per_s(tmux.screen(), m.mountpoint) is not None, 30,
                  "the second view")
    finally:
        reader.kill()
        reader.wait()
    m.unmount()
    screen = _wait_for(lambda: (s := tmux.screen()) and "GONE" in s and s, 15,
                       "the mount to be shown as gone")
    assert "Traceback" not in screen, screen
    tmux("send-keys", "-t", "t", "q")
    _wait_for(lambda: status.exists() and "EXIT=" in status.read_text(), 10, "top to exit")
    assert status.read_text().startswith("EXIT=0")


def test_top_shows_a_read_waiting_on_a_stalled_fetch(dataset: Dataset, nginx,
                                                      mounter: Mounter):
    """The daemon's new figures, for real: a read waits on GETs the proxy stalls; top sees it
    waiting, its wait growing; once released, nothing waits, and the CPU times are there."""
    publish(dataset, nginx.root)
    with FaultProxy(nginx.port) as proxy:
        m = mounter.mount([brace(dataset, f"{proxy.url}/data")], None, None, "--no-warm",
                          "--push-pages", "off")
        proxy.stall(60, after_bytes=0)  # every GET: the whole shard's and any member's
        rel = next(iter(dataset.files()))
        reader = threading.Thread(target=(m.mountpoint / rel).read_bytes, daemon=True)
        reader.start()
        try:
            _wait_for(lambda: m.stats()["reads_in_flight"] == 1, 30, "the read to wait")
            result = subprocess.run([*SHARDFS, "top", "--json", "--count", "3", "--interval",
                                     "0.5", str(m.mountpoint)], capture_output=True, text=True,
                                    timeout=60, cwd=REPO)
        finally:
            proxy.release_stalls()
            reader.join(60)
        assert result.returncode == 0, result.stderr
        waits = [json.loads(line)["mounts"][0] for line in result.stdout.splitlines()][1:]
        assert [w["reads_waiting"] for w in waits] == [1, 1], waits
        assert 0 < waits[0]["oldest_wait_s"] < waits[1]["oldest_wait_s"], waits
        assert waits[0]["shard_fetches"] + waits[0]["member_fetches"] >= 1, waits
        assert not reader.is_alive()
        done = m.stats()
    assert done["reads_in_flight"] == 0 and done["oldest_read_s"] == 0.0, done
    assert done["cpu_s"]["daemon"] > 0, done["cpu_s"]
    assert (done["cpu_s"]["workers"] > 0) == (done["worker_count"] > 0), done  # none unshimmed
    assert done["shim"] is True or os.environ.get("SHARDFS_NO_SHIM")


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bshardfs_[a-z0-9_]+\b", expr))


def _plain_lines_of_all_mounts(m: Mount) -> None:
    """In a pipe, with no MOUNTPOINT: plain lines, ours among every mount of the machine."""
    result = subprocess.run([*SHARDFS, "top", "--count", "2", "--interval", "0.3"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    ours = [line for line in result.stdout.splitlines() if f" {m.mountpoint} " in line]
    assert len(ours) == 2, result.stdout
    assert "state=measuring" in ours[0] and "files/s=" in ours[1] and "hit=" in ours[1], ours
    bad = subprocess.run([*SHARDFS, "top", str(m.mountpoint / "nope")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "not a directory" in bad.stderr


def test_grafana_dashboard_queries_and_plain_top(dataset: Dataset, mounter: Mounter):
    pytest.importorskip("prometheus_client")
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10, "the dashboard should cover what `shardfs top` shows"
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    wanted = set().union(*map(_metric_names, exprs))
    port = free_port()
    m: Mount = mounter.mount([brace(dataset, str(dataset.shard_dir))], None, None,
                             "--metrics-listen", f"127.0.0.1:{port}")
    for rel in list(dataset.files())[:20]:
        (m.mountpoint / rel).read_bytes()
    _plain_lines_of_all_mounts(m)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    exported = {line.split()[0].split("{")[0] for line in body.decode().splitlines()
                if line.startswith("shardfs_")}
    assert wanted <= exported, f"queried but not exported: {sorted(wanted - exported)}"
    for panel in board["panels"]:
        if panel.get("type") != "row":
            assert panel.get("targets"), f"panel {panel.get('title')!r} has no query"
