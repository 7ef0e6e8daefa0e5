"""Where a cold file's CPU goes: per process, per thread, user vs system, and (with a
profiler) per kind of code.

`python -m bench cpusplit [--files 20000] [--kb 24] [--shards 16] [--readers 8]
[--workers 1,2] [--sources file,in-place,http] [--push-pages auto,off] [--rounds 1]
[--profile perf,py-spy] [--variant NAME=DIR[:KEY=VALUE...]]... [--docs PAGE]`

The `bench node` data set and readers (bench/node.py): P reader processes read every file of
a fresh mount once, its cache empty and the page cache dropped, from `file://` shards (`file`:
copied into the cache, `--in-place off`; `in-place`: read from their own files, `--in-place
on`, what the default does on a local disk) and from nginx
on loopback. Around that one cold pass, every thread of every process of the mount
is read from /proc (utime, stime): the daemon's main thread (its trio loop: everything that
holds the GIL to answer FUSE requests and drive fetches), the daemon's other threads (hashing,
page push, disk reads, source reads: they run beside the loop, the GIL released for most of
their work), the worker zygote, each FUSE worker process (`--workers` > 1) and the page
push's lookup process (started during the pass). Reported in µs per file read.

The serial part is the daemon's main thread: one thread, whatever the number of cores, so
1e6 / (its µs per file) bounds the cold files/s of a node. That bound assumes the rest
(threads, workers, the readers themselves) gets cores of its own, and that the threads' GIL
holding is small (the profiler's Python share of them says how small).

`--profile perf` also samples the mount's processes with `perf record` during the pass and
splits each thread group's samples by where the CPU was: the Python interpreter, C
extensions and libraries (hashing in libcrypto, libfuse and the shim, libc copies) and the
kernel; plus the top symbols. Python 3.11 has no perf map, so Python code shows as the
interpreter only; `--profile py-spy` says what the daemon's Python was doing (PHASES);
`--profile syscalls` counts the mount's system calls per file read (bench/syscalls.py: they
do not swing with the VM's sitting as its CPU does); `--profile kernel` samples with call graphs
and splits each thread group's samples by what the kernel was doing for it: splicing into the
cache file, FUSE replies and stores, file reads, TCP in softirq (bench/kernelsplit.py).
`--variant` runs every pass with other code or settings too, in turns (before and after a
change in one run: the machine's load drifts between runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.kernelsplit import describe, kernel_split
from bench.node import (
    Mount,
    add_data_arguments,
    drop_caches,
    make_files,
    read_all,
    replace_section,
)
from bench.pagecost import note_page_cost, page_cost_lines
from bench.procs import CLK_TCK, interrupt
from bench.syscalls import SyscallCount, per_file

MARK_BEGIN = "<!-- cpusplit: begin -->"
MARK_END = "<!-- cpusplit: end -->"


@dataclass
class ThreadTicks:
    name: str
    user: int
    system: int


def _threads(pid: int) -> dict[int, ThreadTicks]:
    """Every live thread of `pid`: tid -> (name, utime, stime) in clock ticks."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        found[int(tid)] = ThreadTicks(name, int(fields[11]), int(fields[12]))
    return found


def _process(pid: int) -> tuple[int, int]:
    """utime, stime of a whole process (exited threads included), in ticks."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0
    return int(fields[11]), int(fields[12])


@dataclass
class Snapshot:
    processes: dict[int, tuple[int, int]] = field(default_factory=dict)
    threads: dict[int, dict[int, ThreadTicks]] = field(default_factory=dict)

    @classmethod
    def take(cls, pids: list[int]) -> Snapshot:
        return cls({pid: _process(pid) for pid in pids}, {pid: _threads(pid) for pid in pids})


def _roles(mount: Mount) -> dict[int, str]:
    """pid -> daemon / zygote / worker N / lookup, from the mount's own stats (its workers'
    pids) and the page push's lookup process's name."""
    from bench.node import _mount_pids

    workers = mount.stats().get("workers") or []
    roles = {mount.pid: "daemon"}
    for pid in _mount_pids(mount.pid):
        if pid == mount.pid:
            continue
        if pid in workers:
            roles[pid] = f"worker {workers.index(pid) + 1}"
        elif _comm(pid) == "shardfs lookup":
            roles[pid] = "lookup"
        else:
            roles[pid] = "zygote"
    return roles


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _thread_group(pid: int, tid: int, name: str) -> str:
    """Threads grouped by what they are: the main thread, or the name without its number."""
    if tid == pid:
        return "main"
    return re.sub(r"[\s_-]*\d+$", "", name) or "thread"


def split(before: Snapshot, after: Snapshot, roles: dict[int, str], files: int) -> dict:
    """µs per file, per process role and per thread group within it, user and system."""
    per_file = 1e6 / CLK_TCK / files
    out: dict[str, dict] = {}
    for pid, role in roles.items():
        if pid not in after.processes:
            continue
        u0, s0 = before.processes.get(pid, (0, 0))
        u1, s1 = after.processes[pid]
        proc = {"user": round((u1 - u0) * per_file, 1), "system": round((s1 - s0) * per_file, 1),
                "threads": {}}
        groups: dict[str, list[int]] = {}
        seen_u = seen_s = 0
        for tid, t in after.threads.get(pid, {}).items():
            old = before.threads.get(pid, {}).get(tid)
            du = t.user - (old.user if old else 0)
            ds = t.system - (old.system if old else 0)
            seen_u += du
            seen_s += ds
            g = groups.setdefault(_thread_group(pid, tid, t.name), [0, 0, 0])
            g[0] += du
            g[1] += ds
            g[2] += 1
        # Threads that ended during the pass: their time is in the process's total only.
        gone_u, gone_s = (u1 - u0) - seen_u, (s1 - s0) - seen_s
        if gone_u > 0 or gone_s > 0:
            groups["(threads that ended)"] = [max(gone_u, 0), max(gone_s, 0), 0]
        for name, (du, ds, n) in sorted(groups.items()):
            proc["threads"][name] = {"user": round(du * per_file, 1),
                                     "system": round(ds * per_file, 1), "count": n}
        out[role] = proc
    return out


# -- perf ------------------------------------------------------------------------------------

class Profiler:
    """A profiler process recording for the length of a pass; SIGINT makes it write out."""

    proc: subprocess.Popen
    path: Path

    def stop(self) -> None:
        interrupt(self.proc)


class Perf(Profiler):
    """`perf record` of some pids (their threads, those started later included) for the
    length of a pass: without call graphs (cheap, `--profile perf`), or with them
    (`--profile kernel`, bench/kernelsplit.py)."""

    def __init__(self, pids: list[int], path: Path, freq: int,
                 call_graphs: bool = False) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            ["perf", "record", *(["-g"] if call_graphs else []), "-F", str(freq), "-q",
             "-o", str(path), "-p", ",".join(map(str, pids))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches


def _dso_kind(dso: str) -> str:
    d = dso.lower()
    if "kernel" in d:
        return "kernel"
    if "python" in d:  # the interpreter (python3.11, libpython)
        return "python"
    if "crypto" in d or "hashlib" in d:
        return "hashing (libcrypto)"
    if "fuse" in d or "_shim" in d:
        return "FUSE C (libfuse, pyfuse3, shim)"
    if "libc" in d:
        return "libc"
    return "other C"


def perf_split(path: Path, tid_group: dict[int, str]) -> dict:
    """Samples per (thread group, code kind) and the top symbols, in percent of all samples."""
    out = subprocess.run(
        ["perf", "report", "-i", str(path), "--stdio", "--no-children", "-s", "pid,comm,dso",
         "-t", "|", "--percent-limit", "0", "-q"], capture_output=True, text=True).stdout
    rows: dict[str, dict[str, float]] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 4 or not parts[0].endswith("%"):
            continue
        pct = float(parts[0].rstrip("%"))
        tid = int(parts[1].split(":", 1)[0])
        group = tid_group.get(tid)
        if group is None:  # a thread that ended: its name at the sample
            group = "(ended) " + re.sub(r"[\s_-]*\d+$", "", parts[2])
        elif not group.endswith(": main"):
            group = group.rsplit(": ", 1)[0] + ": " + re.sub(r"[\s_-]*\d+$", "", parts[2])
        kinds = rows.setdefault(group, {})
        kind = _dso_kind(parts[3])
        kinds[kind] = round(kinds.get(kind, 0.0) + pct, 2)
    syms = subprocess.run(
        ["perf", "report", "-i", str(path), "--stdio", "--no-children", "-s", "dso,sym",
         "-t", "|", "--percent-limit", "0.7", "-q"], capture_output=True, text=True).stdout
    top = []
    for line in syms.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 3 and parts[0].endswith("%"):
            top.append({"pct": float(parts[0].rstrip("%")), "dso": parts[1], "sym": parts[2]})
    return {"by_thread": rows, "top": top[:30]}


# -- py-spy ----------------------------------------------------------------------------------

# What a Python stack is doing, by the first of these found in it (file or function names).
PHASES = [
    ("page push", ("fuse/pagepush.py",)),
    ("hashing", ("check_and_decode", "digest_of_file")),
    ("source read (file://)", ("sources/file.py",)),
    ("HTTP receive", ("httpcore/", "h11/", "httpx/", "sources/http.py")),
    ("cache write + frontier", ("Downloads.write", "pwrite_all", "read/fetch.py",
                                "read/states.py")),
    ("READ answered in Python", ("fuse/ops.py", "Reader._read", "read/diskread.py",
                                 "fuse/remote.py")),
    ("worker RPC", ("util/rpc.py", "daemon/workers.py")),
    ("C reads' counts (collect)", ("fuse/fastread.py", "note_reads", "read/workingset.py")),
    ("fetch bookkeeping", ("cache/shardcache.py", "read/reader.py", "read/download.py")),
    ("thread hops (trio)", ("trio/_threads.py", "trio/_core/_thread_cache.py",
                            "_wakeup_socketpair.py", "_entry_queue.py")),
    ("FUSE loop (pyfuse3, C drain)", ("_pyfuse3.py",)),
    ("trio epoll wait", ("_io_epoll.py",)),
]


class PySpy(Profiler):
    """`py-spy record` of one process for the length of a pass (no pauses: --nonblocking)."""

    def __init__(self, pid: int, path: Path, rate: int, gil: bool = False) -> None:
        self.path = path
        # Not --native: it pauses the process at each sample, and paused while readers wait
        # on it, a FUSE daemon hung py-spy and the readers for good (seen here). --gil: only
        # samples of a thread holding the GIL (running Python, or C called without letting
        # go of it), not a thread waiting in a system call or preempted.
        self.proc = subprocess.Popen(
            [_tool("py-spy") or "py-spy", "record", "-p", str(pid), "--rate", str(rate),
             "--nonblocking", "--threads", *(["--gil"] if gil else []), "--format", "raw",
             "-o", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)


# Stacks whose innermost Python frame is one of these are a thread waiting, not working:
# trio's epoll wait (the loop has nothing to do) and a trio worker thread waiting for its
# next job (`WorkerThread._work`, blocked in a lock's acquire). py-spy's own idle test does
# not see these in --nonblocking mode, so they were counted as "trio epoll wait" and
# "thread hops" work before session 35.
IDLE_LEAVES = ("EpollIOManager.get_events", "WorkerThread._work")


def pyspy_split(path: Path, main_tid: int) -> dict:
    """Python samples of the main thread and of the other threads, by phase, in percent of
    that thread group's busy samples (waits in IDLE_LEAVES left out and counted apart); plus
    the sample counts."""
    counts: dict[str, dict[str, int]] = {"main": {}, "threads": {}}
    idle: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return {}
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        m = re.match(r"thread \((\d+)\)", stack)
        group = "main" if m and int(m.group(1)) == main_tid else "threads"
        if stack.rsplit(";", 1)[-1].split(" (", 1)[0] in IDLE_LEAVES:
            idle[group] = idle.get(group, 0) + int(n)
            continue
        phase = next((name for name, marks in PHASES if any(k in stack for k in marks)),
                     "other")
        counts[group][phase] = counts[group].get(phase, 0) + int(n)
    out = {}
    for group, phases in counts.items():
        total = sum(phases.values())
        if total:
            out[group] = {"samples": total, "idle_samples": idle.get(group, 0), "phases": {
                k: round(100 * v / total, 1)
                for k, v in sorted(phases.items(), key=lambda kv: -kv[1])}}
    return out


# -- the run ---------------------------------------------------------------------------------

@dataclass
class Variant:
    """Which shardfs the mounts run: this checkout, or another one (PYTHONPATH), with extra
    environment variables (`--variant NAME=DIR[:KEY=VALUE...]`): to put code before and
    after a change side by side in one run."""

    name: str
    path: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, rest = text.partition("=")
        path, *pairs = rest.split(":")
        env = dict(p.split("=", 1) for p in pairs if "=" in p)
        return cls(name, os.path.abspath(path) if path else None, env)

    def apply(self) -> dict[str, str | None]:
        """Set this variant's environment (mounts inherit it); what to restore after."""
        saved: dict[str, str | None] = {}
        changes = dict(self.env)
        if self.path:
            # Ahead of what is there (the dependencies may come from PYTHONPATH too)
            changes["PYTHONPATH"] = os.pathsep.join(
                p for p in (self.path, os.environ.get("PYTHONPATH")) if p)
            # `python -m shardfs` puts the working directory first on sys.path, ahead of
            # PYTHONPATH: run from a checkout, every variant ran that checkout (session 20).
            changes["PYTHONSAFEPATH"] = "1"
        for key, value in changes.items():
            saved[key] = os.environ.get(key)
            os.environ[key] = value
        return saved


    def wrong_tree(self) -> str | None:
        """Why this variant's mounts would not run its tree, or None: asks a Python started
        as a mount is (this working directory, the variant's environment; `-c` puts the
        working directory on sys.path as `-m` does)."""
        if not self.path:
            return None
        saved = self.apply()
        try:
            probe = "import shardfs, sys; sys.stdout.write(list(shardfs.__path__)[0])"
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                 timeout=60)
        finally:
            _restore(saved)
        where = Path(out.stdout.strip() or "/")
        if out.returncode == 0 and where.resolve().is_relative_to(Path(self.path).resolve()):
            return None
        return (f"its mounts would import shardfs from {out.stdout.strip() or out.stderr.strip()},"
                f" not from {self.path}")

    def missing_shim(self) -> str | None:
        """Why this variant's mounts would run without the pyfuse3 shim, or None. A tree
        without `_shim` built for this Python mounts anyway, all requests in Python (no C
        reads, no page push, `--workers` unused): measured so on the 16-core machine once,
        ~5,000 files/s against ~30,000 with the shim, and taken for the code's cost."""
        if not self.path:
            return None
        built = Path(self.path, "shardfs", "fuse", "_shim" + sysconfig.get_config_var(
            "EXT_SUFFIX"))
        if built.exists():
            return None
        return (f"{built} is not there: run `python setup.py build_ext --inplace` in "
                f"{self.path} with this Python")


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _cold_pass(sources: list[str], mnt: Path, cache: Path, names: list[str], args,
               label: str, workers: int, work: Path, variant: Variant, push: str) -> dict:
    saved = variant.apply()
    try:
        # file: copied into the cache (what a network file system gets; the default reads
        # a local disk's shards in place)
        in_place = ("--in-place", "on" if label == "in-place" else "off")
        mount = Mount(sources, mnt, cache, workers, push, *in_place)
    finally:
        _restore(saved)
    try:
        roles = _roles(mount)
        pids = list(roles)
        drop_caches()
        perf = spy = calls = kernel = None
        if "syscalls" in args.profile:
            calls = SyscallCount(pids, work / f"syscalls-{label}-{workers}.txt")
        if "perf" in args.profile:
            perf = Perf(pids, work / f"perf-{label}-{workers}.data", args.perf_freq)
        if "py-spy" in args.profile:
            spy = PySpy(mount.pid, work / f"spy-{label}-{workers}.txt", args.spy_rate,
                        args.spy_gil)
        if "kernel" in args.profile:
            kernel = Perf(pids, work / f"kernel-{label}-{workers}.data", args.perf_freq,
                          call_graphs=True)
        before = Snapshot.take(pids)
        rec = read_all(mnt, names, args.readers, seed=args.readers, list_first=args.list)
        roles = {**_roles(mount), **roles}  # and the push's lookup process, started meanwhile
        after = Snapshot.take(list(roles))
        for profiler in (perf, spy, kernel):
            if profiler is not None:
                profiler.stop()
        if calls is not None:  # (the lookup process, started meanwhile, is not counted)
            rec["syscalls"] = calls.stop()
            rec["files_read"] = len(names)
        rec.update(source=label, workers=workers, readers=args.readers, variant=variant.name,
                   push_pages=push)
        with contextlib.suppress(OSError):
            rec["stats"] = mount.stats()
        rec["split"] = split(before, after, roles, len(names))
        daemon = rec["split"]["daemon"]
        main = daemon["threads"].get("main", {"user": 0, "system": 0})
        serial = main["user"] + main["system"]
        everything = sum(p["user"] + p["system"] for p in rec["split"].values())
        rec["serial_us_per_file"] = round(serial, 1)
        rec["daemon_process_us_per_file"] = round(daemon["user"] + daemon["system"], 1)
        rec["all_us_per_file"] = round(everything, 1)
        rec["bound_files_per_s"] = round(1e6 / serial) if serial > 0 else None
        tid_group = {tid: f"{roles[pid]}: {_thread_group(pid, tid, t.name)}"
                     for pid, threads in after.threads.items() for tid, t in threads.items()}
        if perf is not None:
            rec["perf"] = perf_split(perf.path, tid_group)
            _keep(perf.path, args.keep_profiles)
        if kernel is not None:
            rec["kernel"] = kernel_split(kernel.path, tid_group)
            _keep(kernel.path, args.keep_profiles)
        if spy is not None:
            rec["pyspy"] = pyspy_split(spy.path, mount.pid)
            _keep(spy.path, args.keep_profiles)
        return rec
    finally:
        mount.close()
        shutil.rmtree(cache, ignore_errors=True)


def _keep(path: Path, where: str | None) -> None:
    """Move a profile to `where` (--keep-profiles), or delete it."""
    if not path.exists():
        return
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        shutil.move(path, Path(where) / path.name)
    else:
        path.unlink(missing_ok=True)


def _print(rec: dict) -> None:
    print(f"  [{rec['variant']}] {rec['source']} workers={rec['workers']} P={rec['readers']} "
          f"push {rec.get('push_pages', 'auto')}: "
          f"{rec['files_per_s']:.0f} files/s; µs/file: all {rec['all_us_per_file']}, daemon "
          f"process {rec['daemon_process_us_per_file']}, serial (daemon main thread) "
          f"{rec['serial_us_per_file']} -> bound {rec['bound_files_per_s']} files/s; pushed / "
          f"opened first {_pushed(rec)}; shim {(rec.get('stats') or {}).get('shim', '?')}"
          + (f"; listed first in {rec['list_s']} s" if "list_s" in rec else ""),
          flush=True)
    for role, proc in rec["split"].items():
        threads = ", ".join(f"{n} {t['user']}+{t['system']}"
                            for n, t in proc["threads"].items())
        print(f"    {role}: user {proc['user']} + system {proc['system']} ({threads})",
              flush=True)
    for group, kinds in sorted(rec.get("perf", {}).get("by_thread", {}).items()):
        print(f"    perf {group}: " + ", ".join(f"{k} {v}%" for k, v in
                                                sorted(kinds.items(), key=lambda kv: -kv[1])))
    if "syscalls" in rec:
        print(f"    system calls per file: {per_file(rec['syscalls'], rec['files_read'])}")
    if "kernel" in rec:
        print(f"    kernel call graphs (% of the mount's samples): {describe(rec['kernel'])}")
    for group, spy in rec.get("pyspy", {}).items():
        print(f"    py-spy daemon {group} ({spy['samples']} busy samples, "
              f"{spy.get('idle_samples', 0)} waiting): "
              + ", ".join(f"{k} {v}%" for k, v in spy["phases"].items()))


def _per_pass(record: dict, key: str, heading: str, line: Callable[[dict], str]) -> list[str]:
    """A heading and one line per pass that has `key` (a profile's result), or nothing."""
    passes = [r for r in record["passes"] if key in r]
    if not passes:
        return []
    return ["", heading, "", *(f"- {rec['variant']}, {rec['source']}, "
                               f"workers={rec['workers']}: {line(rec)}" for rec in passes)]


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="shardfs-cpusplit-", dir=args.workdir))
    params = {k: v for k, v in vars(args).items() if k != "variant"}
    params["variant"] = [vars(v) for v in args.variant]
    record: dict = {"params": params,
                    "passes": []}
    nginx = None
    try:
        src = work / "files"
        names = make_files(src, args.files, args.kb)
        from shardfs.pack import pack

        shards = work / "shards"
        pack(src, shards, prefix="node", samples_per_shard=-(-args.files // args.shards))
        shard_paths = sorted(str(p) for p in shards.glob("node-*.tar"))
        shutil.rmtree(src)  # the readers read the mount only
        by_source = {"file": [f"file://{p}" for p in shard_paths]}
        by_source["in-place"] = by_source["file"]  # mounted with --in-place on
        if "http" in args.sources:
            from shardfs.devtools.nginx import Nginx

            nginx = Nginx(shards, work / "nginx").start()
            by_source["http"] = [f"{nginx.url}/{Path(p).name}" for p in shard_paths]
        record["dataset"] = {"files": len(names), "shards": len(shard_paths),
                             "bytes": sum(os.path.getsize(p) for p in shard_paths)}
        mnt = work / "mnt"
        mnt.mkdir()
        drop_caches()  # this sitting's price of a new page, beside the passes that pay it
        note_page_cost(record, "start", work)
        # Variants in turns within each round: side by side under the same load.
        for round_ in range(args.rounds):
            for workers in args.workers:
                for label in args.sources:
                    for push in args.push_pages:
                        for variant in args.variant:
                            rec = _cold_pass(by_source[label], mnt, work / "cache", names,
                                             args, label, workers, work, variant, push)
                            rec["round"] = round_
                            record["passes"].append(rec)
                            _print(rec)
        drop_caches()
        note_page_cost(record, "end", work)
    finally:
        if nginx is not None:
            nginx.stop()
        shutil.rmtree(work, ignore_errors=True)
    return record


def _pushed(rec: dict) -> str:
    pushed = (rec.get("stats") or {}).get("pages_pushed")
    if not pushed:
        return "–"
    listed = f" ({pushed['listed']:,} listed)" if pushed.get("listed") else ""
    return f"{pushed['files']:,}{listed} / {pushed['opened']:,}"


def _bound(rec: dict) -> str:
    """The serial bound, or "–" where the main thread's CPU rounded to 0 (a pass so short
    that no clock tick of it fell on the main thread)."""
    bound = rec["bound_files_per_s"]
    return f"{bound:,}" if bound is not None else "–"


def render(record: dict, command: str) -> str:
    ds = record["dataset"]
    lines = [MARK_BEGIN, "", f"`{command}` — {ds['files']} files in {ds['shards']} shards "
             f"({ds['bytes'] / 1e6:.0f} MB), one cold pass each (fresh cache, page cache "
             "dropped). µs of CPU per file read, user + system; the serial part is the "
             "daemon's main thread, and its bound is 1e6 / that.", "",
             "| code | source | workers | files/s | all processes | daemon process | daemon "
             "main thread (serial) | daemon other threads | workers (each) | lookup process "
             "| bound files/s | files pushed / opened first |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in record["passes"]:
        daemon = rec["split"]["daemon"]
        main = daemon["threads"].get("main", {"user": 0, "system": 0})
        others = [(n, t) for n, t in daemon["threads"].items() if n != "main"]
        other_txt = "; ".join(f"{n} {t['user']}+{t['system']}" for n, t in others) or "–"
        workers = [p for r, p in rec["split"].items() if r.startswith("worker")]
        worker_txt = " / ".join(f"{p['user']}+{p['system']}" for p in workers) or "–"
        lookup = rec["split"].get("lookup")
        lookup_txt = f"{lookup['user']}+{lookup['system']}" if lookup else "–"
        lines.append(
            f"| {rec['variant']} | {rec['source']} | {rec['workers']} | "
            f"{rec['files_per_s']:,.0f} | "
            f"{rec['all_us_per_file']} | {daemon['user']}+{daemon['system']} | "
            f"{main['user']}+{main['system']} | {other_txt} | {worker_txt} | {lookup_txt} | "
            f"{_bound(rec)} | {_pushed(rec)} |")
    lines += ["", "Files pushed: their pages were put in the page cache when their shard "
              "arrived (no READ reaches the mount); opened first: read through FUSE READs "
              "while their shard was still coming. The mix changes the CPU per file from "
              "pass to pass."]
    lines += page_cost_lines(record)
    perfs = [r for r in record["passes"] if "perf" in r]
    if perfs:
        lines += ["", "Where the samples were (`--profile perf`, % of the pass's samples of "
                  "the mount's processes):", ""]
        for rec in perfs:
            lines.append(f"- {rec['variant']}, {rec['source']}, workers={rec['workers']}: "
                         + "; ".join(
                f"{group}: " + ", ".join(f"{k} {v:.0f}%" for k, v in
                                         sorted(kinds.items(), key=lambda kv: -kv[1])
                                         if v >= 0.5)
                for group, kinds in sorted(rec["perf"]["by_thread"].items())))
    lines += _per_pass(record, "syscalls", "System calls of the mount's processes per file "
                       "read (`--profile syscalls`, perf's counts of `syscalls:sys_enter_*`), "
                       "the most made:", lambda rec: per_file(rec["syscalls"], rec["files_read"]))
    lines += _per_pass(record, "kernel", "What the mount's threads were doing (`--profile "
                       "kernel`, perf's call graphs: % of the mount's samples; user = no "
                       "kernel frame):", lambda rec: describe(rec["kernel"]))
    spies = [r for r in record["passes"] if "pyspy" in r]
    if spies:
        lines += ["", "What the daemon's Python was doing (`--profile py-spy`, % of the "
                  "busy samples of its main thread / of its other threads; a thread "
                  "waiting in trio's epoll or for its next job is not busy):", ""]
        for rec in spies:
            lines.append(f"- {rec['variant']}, {rec['source']}, workers={rec['workers']}: "
                         + "; ".join(
                f"{group}: " + ", ".join(f"{k} {v:.0f}%" for k, v in spy["phases"].items()
                                         if v >= 1)
                for group, spy in rec["pyspy"].items()))
    lines += ["", MARK_END]
    return "\n".join(lines)


def write_docs(page: Path, section: str) -> None:
    replace_section(page, section, MARK_BEGIN, MARK_END)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p)
    p.add_argument("--readers", type=int, default=8, help="reader processes")
    p.add_argument("--workers", default="1,2", help="shardfs --workers values, comma-separated")
    p.add_argument("--sources", default="file,http",
                   help="file, in-place (file:// with --in-place on) and/or http, "
                   "comma-separated")
    p.add_argument("--rounds", type=int, default=1, help="turns through all passes")
    p.add_argument("--push-pages", default="auto",
                   help="shardfs --push-pages: auto and/or off, comma-separated (in turns)")
    p.add_argument("--profile", default="none",
                   help="none, or perf, py-spy, syscalls and/or kernel (comma-separated): "
                        "also sample the mount's processes with perf (Debian linux-perf), the "
                        "daemon with py-spy, count the mount's system calls (perf stat), or "
                        "sample with call graphs and split by what the kernel was doing")
    p.add_argument("--perf-freq", type=int, default=499, help="perf samples per second")
    p.add_argument("--spy-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--spy-gil", action="store_true",
                   help="py-spy samples only threads holding the GIL (py-spy --gil): Python's "
                        "CPU, not its waits")
    p.add_argument("--keep-profiles", default=None,
                   help="keep perf.data and py-spy's raw stacks in this folder")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=DIR[:KEY=VALUE...]: run each pass also with the shardfs in DIR "
                        "(PYTHONPATH; its shim built) and these environment variables, in "
                        "turns (repeatable; default: this checkout as 'this')")
    p.add_argument("--workdir", default=None,
                   help="where data, shards and caches go (made if missing)")
    p.add_argument("--out", default="bench/out", help="where the JSON record goes")
    p.add_argument("--docs", default=None, help="also update this page's cpusplit section")


def _tool(name: str) -> str | None:
    """A program on PATH, or beside this interpreter (a virtualenv's py-spy when the bench
    runs as .venv/bin/python without the venv's bin on PATH)."""
    found = shutil.which(name)
    if found is None:
        beside = Path(sys.executable).parent / name
        found = str(beside) if os.access(beside, os.X_OK) else None
    return found


def cpusplit_command(args: argparse.Namespace, argv: list[str]) -> int:
    args.workers = [int(x) for x in str(args.workers).split(",")]
    args.variant = [Variant.parse(v) for v in args.variant] or [Variant("this")]
    for variant in args.variant:
        why = variant.wrong_tree() or variant.missing_shim()
        if why:
            print(f"bench cpusplit: variant {variant.name}: {why}", file=sys.stderr)
            return 2
    args.sources = [s.strip() for s in str(args.sources).split(",")]
    args.push_pages = [s.strip() for s in str(args.push_pages).split(",")]
    if set(args.push_pages) - {"auto", "off"}:
        print(f"bench cpusplit: --push-pages takes auto and/or off, not {args.push_pages}",
              file=sys.stderr)
        return 2
    bad = [s for s in args.sources if s not in ("file", "in-place", "http")]
    if bad:
        print(f"bench cpusplit: unknown source {bad[0]!r} (file, in-place, http)",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench cpusplit: run as root (drop_caches, mounts)", file=sys.stderr)
        return 2
    args.profile = [p.strip() for p in str(args.profile).split(",") if p.strip() != "none"]
    for kind, tool, where in (("perf", "perf", "apt-get install linux-perf"),
                              ("syscalls", "perf", "apt-get install linux-perf"),
                              ("kernel", "perf", "apt-get install linux-perf"),
                              ("py-spy", "py-spy", "pip install py-spy")):
        if kind in args.profile and _tool(tool) is None:
            print(f"bench cpusplit: --profile {kind} needs {tool} ({where})", file=sys.stderr)
            return 2
    if set(args.profile) - {"perf", "py-spy", "syscalls", "kernel"}:
        print(f"bench cpusplit: unknown --profile {args.profile}", file=sys.stderr)
        return 2
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    record = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cpusplit-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    section = render(record, ("python -m bench cpusplit " + " ".join(argv)).strip())
    print(section)
    if args.docs:
        write_docs(Path(args.docs), section)
    print(f"record: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.cpusplit` (the same as `python -m bench cpusplit`, without importing
    the other benchmarks' modules)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.cpusplit", description=__doc__)
    add_arguments(p)
    return cpusplit_command(p.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
