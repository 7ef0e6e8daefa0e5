"""The "node" scenario: many reader processes against one mount, as a GPU node's DataLoader
workers are, against the same files on local ext4 in the same run.

`python -m bench node [--files 20000] [--kb 24] [--shards 16] [--readers 1,4,8]
[--workers 1] [--docs docs/benchmarks.md]`

Each reader process opens, reads and closes every file of its share of one shuffled list.
Phases per reader count P:
- ext4 warm (page cache holds the files) and ext4 dropped (`drop_caches` first);
- shardfs cold from `file://` copied (`--in-place off`, as a network file system's shards are:
  fresh cache dir, the daemon copies shards from the source while serving), then page cache
  dropped (the shard cache on disk, `drop_caches` first), then warm (a second pass over the
  page cache);
- shardfs cold from `file://` read in place (`--in-place on`, what the default `auto` does on
  a local disk: the shards' own files serve the reads, nothing copied; `drop_caches` first);
- shardfs cold from HTTP (nginx on loopback, no latency, no bandwidth cap; `--no-http`: left
  out).
Daemon CPU (utime+stime of every process of the mount) per file read is recorded with each
shardfs phase. Run as root (mounts, drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.pagecost import note_page_cost, page_cost_lines
from bench.procs import CLK_TCK, unmount

SHARDFS = [sys.executable, "-m", "shardfs"]
MARK_BEGIN = "<!-- node scenario: begin -->"
MARK_END = "<!-- node scenario: end -->"


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def make_files(root: Path, n: int, kb: float, seed: int = 0) -> list[str]:
    """`n` files of about `kb` KiB in 100 class directories (random bytes: size matters here,
    not content)."""
    rng = random.Random(seed)
    names = []
    for i in range(n):
        rel = f"c{i % 100:03d}/f{i:07d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        size = max(1, int(rng.gauss(kb * 1024, kb * 256)))
        path.write_bytes(rng.randbytes(size))
        names.append(rel)
    return names


def _reader(root: str, names: list[str], ready_w: int, go_r: int, out_w: int) -> None:
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    t0 = time.monotonic()
    total = 0
    for rel in names:
        with open(os.path.join(root, rel), "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    os.write(out_w, json.dumps({"s": time.monotonic() - t0, "bytes": total}).encode())


def read_all(root: Path, names: list[str], procs: int, seed: int,
             list_first: bool = False) -> dict:
    """Files/s with `procs` processes each reading its share of one shuffled list.
    `list_first`: the tree is listed first (os.walk, as ImageFolder builds its list), timed
    apart (`list_s`): the readers start after it."""
    order = names[:]
    random.Random(seed).shuffle(order)
    shares = [order[i::procs] for i in range(procs)]
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    outs, pids = [], []
    for share in shares:
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                _reader(str(root), share, ready_w, go_r, out_w)
            finally:
                os._exit(0)
        os.close(out_w)
        outs.append(out_r)
        pids.append(pid)
    for _ in pids:
        os.read(ready_r, 1)
    listed = None
    if list_first:
        t0 = time.monotonic()
        sum(len(files) for _, _, files in os.walk(root))
        listed = round(time.monotonic() - t0, 3)
    t0 = time.monotonic()
    os.write(go_w, b"g" * procs)
    results = []
    for out_r in outs:
        data = b""
        while chunk := os.read(out_r, 4096):
            data += chunk
        os.close(out_r)
        results.append(json.loads(data))
    wall = time.monotonic() - t0
    for pid in pids:
        os.waitpid(pid, 0)
    for fd in (ready_r, ready_w, go_r, go_w):
        os.close(fd)
    rec = {"files_per_s": round(len(names) / wall, 1), "wall_s": round(wall, 3),
           "bytes": sum(r["bytes"] for r in results)}
    if listed is not None:
        rec["list_s"] = listed
    return rec


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total


def _mount_pids(pid: int) -> list[int]:
    """The daemon and every process below it (the worker zygote and its workers)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True,
                         text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(x) for x in line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


class Mount:
    def __init__(self, sources: list[str], mountpoint: Path, cache_dir: Path,
                 workers: int, push_pages: str = "auto", *extra: str) -> None:
        # --workers always: the default is one per core, not 1
        args = [*SHARDFS, "mount", *sources, str(mountpoint), "--cache-dir", str(cache_dir),
                "--no-warm", "--push-pages", push_pages, "--workers", str(workers), *extra]
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
        match = re.search(r"daemon pid (\d+)", result.stdout)
        if result.returncode != 0 or not match:
            raise RuntimeError(f"mount failed: {result.stdout}{result.stderr}")
        self.pid = int(match.group(1))
        self.mountpoint = mountpoint

    def cpu_ticks(self) -> int:
        return _cpu_ticks(_mount_pids(self.pid))

    def stats(self) -> dict:
        return json.loads(os.getxattr(self.mountpoint, "user.shardfs.stats"))

    def close(self) -> None:
        unmount(self.mountpoint)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and Path(f"/proc/{self.pid}").exists():
            time.sleep(0.05)


def _machine_ticks() -> tuple[int, int, int]:
    """(all, idle, iowait) CPU ticks of the whole machine so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]), fields[3], fields[4]  # user..steal; guest is counted in user


def _measured(mount: Mount, names: list[str], procs: int, seed: int,
              list_first: bool = False) -> dict:
    before, machine = mount.cpu_ticks(), _machine_ticks()
    rec = read_all(mount.mountpoint, names, procs, seed, list_first)
    used = (mount.cpu_ticks() - before) / CLK_TCK
    rec["daemon_cpu_us_per_file"] = round(1e6 * used / len(names), 1)
    # How busy the machine's cores were: a phase that keeps them all busy cannot gain from
    # more serving processes (issue #11 on 2 cores), only from cheaper work per file.
    total, idle, iowait = (a - b for a, b in zip(_machine_ticks(), machine, strict=True))
    if total > 0:
        rec["machine_busy"] = round(1 - (idle + iowait) / total, 3)
        rec["machine_iowait"] = round(iowait / total, 3)
    return rec


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="shardfs-node-", dir=args.workdir))
    record: dict = {"params": vars(args).copy(), "phases": []}
    nginx = None
    try:
        src = work / "files"
        names = make_files(src, args.files, args.kb)
        from shardfs.pack import pack

        shards = work / "shards"
        per_shard = -(-args.files // args.shards)
        result = pack(src, shards, prefix="node", samples_per_shard=per_shard)
        pattern = result.pattern
        shard_paths = sorted(str(p) for p in shards.glob("node-*.tar"))
        file_sources = [f"file://{p}" for p in shard_paths]
        http_sources = []
        if not args.no_http:
            from shardfs.devtools.nginx import Nginx

            nginx = Nginx(shards, work / "nginx").start()
            http_sources = [f"{nginx.url}/{Path(p).name}" for p in shard_paths]
        record["dataset"] = {"files": len(names), "shards": len(shard_paths),
                             "bytes": sum(os.path.getsize(p) for p in shard_paths),
                             "pattern": pattern}
        mnt = work / "mnt"
        mnt.mkdir()

        def phase(name: str, procs: int, rec: dict) -> None:
            rec.update(phase=name, readers=procs, workers=args.workers,
                       push_pages=args.push_pages)
            record["phases"].append(rec)
            print(f"  P={procs} {name}: {rec['files_per_s']:.0f} files/s"
                  + (f", daemon {rec['daemon_cpu_us_per_file']} us/file"
                     if "daemon_cpu_us_per_file" in rec else "")
                  + (f", cores {rec['machine_busy']:.0%} busy ({rec['machine_iowait']:.0%} "
                     "iowait)" if "machine_busy" in rec else "")
                  + (f", listed first in {rec['list_s']} s" if "list_s" in rec else ""),
                  flush=True)

        # This sitting's price of a new page, beside the passes that pay it (bench/pagecost.py).
        drop_caches()
        note_page_cost(record, "start", work)
        for procs in args.readers:
            seed = procs
            read_all(src, names, procs, seed)  # warm the page cache
            phase("ext4 warm", procs, read_all(src, names, procs, seed))
            drop_caches()
            phase("ext4 dropped", procs, read_all(src, names, procs, seed, args.list))

            cache = work / f"cache-file-{procs}"
            mount = Mount(file_sources, mnt, cache, args.workers, args.push_pages,
                          "--in-place", "off")  # copied: what a network file system gets
            try:
                drop_caches()
                phase("shardfs cold file://", procs,
                      _measured(mount, names, procs, seed, args.list))
                drop_caches()
                phase("shardfs dropped", procs, _measured(mount, names, procs, seed, args.list))
                _measured(mount, names, procs, seed)
                phase("shardfs warm", procs, _measured(mount, names, procs, seed))
                record.setdefault("stats", {})[f"P={procs}"] = mount.stats()
            finally:
                mount.close()
            shutil.rmtree(cache, ignore_errors=True)

            cache = work / f"cache-in-place-{procs}"
            mount = Mount(file_sources, mnt, cache, args.workers, args.push_pages,
                          "--in-place", "on")
            try:
                drop_caches()
                phase("shardfs cold file:// in place", procs,
                      _measured(mount, names, procs, seed, args.list))
            finally:
                mount.close()
            shutil.rmtree(cache, ignore_errors=True)

            if args.no_http:
                continue
            cache = work / f"cache-http-{procs}"
            mount = Mount(http_sources, mnt, cache, args.workers, args.push_pages)
            try:
                drop_caches()
                phase("shardfs cold http", procs,
                      _measured(mount, names, procs, seed, args.list))
            finally:
                mount.close()
            shutil.rmtree(cache, ignore_errors=True)
        drop_caches()
        note_page_cost(record, "end", work)
    finally:
        if nginx is not None:
            nginx.stop()
        shutil.rmtree(work, ignore_errors=True)
    return record


def make_meta(root: Path, n: int, classes: int = 1000) -> None:
    """`n` empty `.jpg` files in `classes` class directories (an ImageNet-shaped namespace)."""
    for i in range(n):
        d = root / f"n{i % classes:05d}"
        if i < classes:
            d.mkdir(parents=True)
        (d / f"f{i:07d}.jpg").touch()


def _timed_walk(root: Path) -> dict:
    t0 = time.monotonic()
    files = sum(len(f) for _, _, f in os.walk(root))
    walk = time.monotonic() - t0
    drop_caches()
    from torchvision.datasets import ImageFolder

    t0 = time.monotonic()
    ds = ImageFolder(str(root))
    imagefolder = time.monotonic() - t0
    return {"files": files, "walk_s": round(walk, 3), "imagefolder_s": round(imagefolder, 3),
            "imagefolder_files": len(ds)}


def run_meta(args: argparse.Namespace) -> dict:
    """os.walk and ImageFolder(root) after drop_caches: ext4 vs a fresh shardfs mount, and
    the time a remount takes."""
    work = Path(tempfile.mkdtemp(prefix="shardfs-meta-", dir=args.workdir))
    try:
        src = work / "files"
        make_meta(src, args.meta)
        from shardfs.pack import pack

        pack(src, work / "shards", prefix="meta", samples_per_shard=max(1, args.meta // 16))
        sources = sorted(f"file://{p}" for p in (work / "shards").glob("meta-*.tar"))
        mnt, cache = work / "mnt", work / "cache"
        mnt.mkdir()
        Mount(sources, mnt, cache, args.workers, args.push_pages).close()  # index once
        t0 = time.monotonic()
        mount = Mount(sources, mnt, cache, args.workers, args.push_pages)
        remount = round(time.monotonic() - t0, 3)
        runs: list[dict] = []
        try:
            # ext4 and shardfs in turns, each after drop_caches; the median run counts.
            for _ in range(args.meta_runs):
                drop_caches()
                ext4 = _timed_walk(src)
                drop_caches()
                runs.append({"ext4": ext4, "shardfs": _timed_walk(mnt)})
        finally:
            mount.close()
        for run_ in runs:
            run_["walk_ratio"] = round(run_["shardfs"]["walk_s"] / run_["ext4"]["walk_s"], 2)
            run_["imagefolder_ratio"] = round(
                run_["shardfs"]["imagefolder_s"] / run_["ext4"]["imagefolder_s"], 2)
        median = sorted(runs, key=lambda r: r["walk_ratio"])[len(runs) // 2]
        rec = {"files": args.meta, **median, "remount_s": remount, "runs": runs}
        print(f"  meta {args.meta} files (median of {len(runs)}): os.walk "
              f"{rec['walk_ratio']}x ext4, ImageFolder {rec['imagefolder_ratio']}x ext4 "
              f"(all: {[r['walk_ratio'] for r in runs]}, "
              f"{[r['imagefolder_ratio'] for r in runs]}), remount {remount} s", flush=True)
        return rec
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ratios(record: dict) -> list[dict]:
    """Per (readers, workers): shardfs phases against ext4 of the same run."""
    rows = []
    by = {(p["readers"], p["phase"]): p for p in record["phases"]}
    for procs in sorted({p["readers"] for p in record["phases"]}):
        def fps(name: str, procs: int = procs) -> float | None:
            p = by.get((procs, name))
            return p["files_per_s"] if p else None

        def cpu(name: str, procs: int = procs) -> float | None:
            p = by.get((procs, name))
            return p.get("daemon_cpu_us_per_file") if p else None

        rows.append({"readers": procs, "ext4_warm": fps("ext4 warm"),
                     "ext4_dropped": fps("ext4 dropped"),
                     "warm": fps("shardfs warm"), "dropped": fps("shardfs dropped"),
                     "cold_file": fps("shardfs cold file://"),
                     "cold_in_place": fps("shardfs cold file:// in place"),
                     "cold_http": fps("shardfs cold http"),
                     "cpu_warm": cpu("shardfs warm"), "cpu_dropped": cpu("shardfs dropped"),
                     "cpu_cold": cpu("shardfs cold file://"),
                     "cpu_in_place": cpu("shardfs cold file:// in place"),
                     "cpu_http": cpu("shardfs cold http")})
    return rows


def render(record: dict, command: str) -> str:
    ds = record["dataset"] or {"files": 0, "shards": 0, "bytes": 0}
    workers = record["params"]["workers"]
    lines = [MARK_BEGIN, "", f"### Node scenario (workers={workers})", "",
             f"`{command}` — {ds['files']} files in {ds['shards']} shards "
             f"({ds['bytes'] / 1e6:.0f} MB), P reader processes each opening, reading and "
             "closing its share of one shuffled list"
             + (" after one `os.walk` of the tree, as ImageFolder lists (`--list`: the dropped "
                "and cold passes; the walk's time apart, its daemon CPU counted)"
                if record["params"].get("list") else "")
             + "; files/s, ratio to ext4 in brackets "
             "(warm vs ext4 warm; dropped and cold vs ext4 dropped); daemon CPU per file.", "",
             "| P | ext4 warm | ext4 dropped | shardfs warm | shardfs dropped | cold file:// "
             "copied | cold file:// in place | cold HTTP | daemon µs/file (warm / dropped / "
             "cold copied / in place / HTTP) |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(v: float | None, ref: float | None) -> str:
        if v is None:
            return "–"
        return f"{v:,.0f} ({v / ref:.2f}x)" if ref else f"{v:,.0f}"

    for r in ratios(record):
        lines.append(
            f"| {r['readers']} | {r['ext4_warm']:,.0f} | {r['ext4_dropped']:,.0f} | "
            f"{cell(r['warm'], r['ext4_warm'])} | {cell(r['dropped'], r['ext4_dropped'])} | "
            f"{cell(r['cold_file'], r['ext4_dropped'])} | "
            f"{cell(r['cold_in_place'], r['ext4_dropped'])} | "
            f"{cell(r['cold_http'], r['ext4_dropped'])} | "
            f"{r['cpu_warm']} / {r['cpu_dropped']} / {r['cpu_cold']} / "
            f"{r['cpu_in_place'] if r['cpu_in_place'] is not None else '–'} / "
            f"{r['cpu_http'] if r['cpu_http'] is not None else '–'} |")
    lines += page_cost_lines(record)
    meta = record.get("meta")
    if meta:
        e, s = meta["ext4"], meta["shardfs"]
        lines += ["", f"Metadata after `drop_caches`, {meta['files']:,} files in 1,000 "
                  f"directories: `os.walk` {s['walk_s']} s vs ext4 {e['walk_s']} s "
                  f"({meta['walk_ratio']}x); `ImageFolder(root)` {s['imagefolder_s']} s vs "
                  f"{e['imagefolder_s']} s ({meta['imagefolder_ratio']}x); the median of "
                  f"{len(meta.get('runs', [meta]))} runs in turns (os.walk ratios "
                  f"{[r['walk_ratio'] for r in meta.get('runs', [meta])]}, ImageFolder "
                  f"{[r['imagefolder_ratio'] for r in meta.get('runs', [meta])]}); remount "
                  f"with the index cached {meta['remount_s']} s (the `shardfs mount` "
                  "command, start to ready)."]
    lines += ["", MARK_END]
    return "\n".join(lines)


SUBSECTION = "### Node scenario (workers="


def _subsections(block: str) -> dict[str, str]:
    """The per-workers subsections between the markers, by their heading."""
    parts = block.split(SUBSECTION)
    return {SUBSECTION + part.split("\n", 1)[0]: (SUBSECTION + part).rstrip() + "\n"
            for part in parts[1:]}


def write_docs(page: Path, section: str) -> None:
    """Put `section` (one run's table) between the page's markers, replacing the table of a
    run with the same --workers and keeping the others (ordered by workers)."""
    text = page.read_text() if page.exists() else ""
    inner = section.split(MARK_BEGIN, 1)[1].split(MARK_END, 1)[0]
    if MARK_BEGIN in text and MARK_END in text:
        old = text.split(MARK_BEGIN, 1)[1].split(MARK_END, 1)[0]
        tables = {**_subsections(old), **_subsections(inner)}
        ordered = sorted(tables, key=lambda h: int(h[len(SUBSECTION):].split(")")[0]))
        body = "\n" + "\n".join(tables[h] for h in ordered) + "\n"
        section = MARK_BEGIN + "\n" + body + MARK_END
    replace_section(page, section, MARK_BEGIN, MARK_END)


def replace_section(page: Path, section: str, begin: str, end: str) -> None:
    """Put `section` (which starts with `begin` and ends with `end`) in place of what stands
    between those markers on the page, or at its end when they are not there."""
    text = page.read_text() if page.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    page.write_text(text)


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The generated files' arguments (bench node's; bench cpusplit's too)."""
    p.add_argument("--files", type=int, default=20000)
    p.add_argument("--kb", type=float, default=24.0, help="mean file size in KiB")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--list", action="store_true",
                   help="cold passes list the tree first (os.walk, as ImageFolder builds its "
                        "list), timed apart; the daemon's CPU includes the listing's")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p)
    p.add_argument("--readers", default="1,4,8", help="reader process counts, comma-separated")
    p.add_argument("--workers", type=int, default=1, help="shardfs --workers")
    p.add_argument("--push-pages", choices=("auto", "off"), default="auto",
                   help="shardfs --push-pages")
    p.add_argument("--no-http", action="store_true",
                   help="leave out the cold HTTP phases (a machine without nginx)")
    p.add_argument("--meta", type=int, default=0,
                   help="also time os.walk/ImageFolder over this many empty files (0: skip)")
    p.add_argument("--meta-runs", type=int, default=3,
                   help="metadata: ext4 and shardfs walked this many times in turns (median)")
    p.add_argument("--skip-reads", action="store_true", help="only the metadata part")
    p.add_argument("--workdir", default=None,
                   help="where data, shards and caches go (made if missing)")
    p.add_argument("--out", default="bench/out", help="where the JSON record goes")
    p.add_argument("--docs", default=None, help="also update this page's node section")


def node_command(args: argparse.Namespace, argv: list[str]) -> int:
    args.readers = [int(x) for x in str(args.readers).split(",")]
    if os.geteuid() != 0:
        print("bench node: run as root (drop_caches, mounts)", file=sys.stderr)
        return 2
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    record = {"params": vars(args).copy(), "phases": [], "dataset": {}} if args.skip_reads \
        else run(args)
    if args.meta:
        record["meta"] = run_meta(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"node-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    command = "python -m bench node " + " ".join(argv)
    section = render(record, command.strip())
    print(section)
    if args.docs:
        write_docs(Path(args.docs), section)
    print(f"record: {path}")
    return 0
