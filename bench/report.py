"""docs/benchmarks.md (+ a PNG chart) from one run's JSON record. All comparisons are ratios
within that one run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.run import SCENARIO_TITLES

HEADLINE_EPOCHS = [("main", "cold", "Cold epoch (dataset fits every cache, nothing cached yet)"),
                   ("main", "warm", "Warm epoch (second epoch on the same mount/cache)"),
                   ("main", "decode", "Decode epoch (third epoch: PIL decode + Resize(256) + "
                    "CenterCrop(224))"),
                   ("small", "cold", "Small files (~20 KiB): cold epoch"),
                   ("small", "warm", "Small files (~20 KiB): warm epoch"),
                   ("over", "epoch1", "Dataset ~4x the cache: first epoch"),
                   ("over", "epoch2", "Dataset ~4x the cache: second epoch, after a remount "
                    "(page cache of the mount dropped, the daemon's disk cache kept)")]
PANEL_TITLES = {("main", "cold"): "Cold epoch", ("main", "warm"): "Warm epoch",
                ("small", "cold"): "Small files (~20 KiB), cold epoch",
                ("over", "epoch1"): "Dataset ~4x the cache, epoch 1",
                ("over", "epoch2"): "Dataset ~4x the cache, epoch 2 (remounted)"}
STATUS_TEXT = {"failed": "FAILED", "timeout": "TIMEOUT", "unavailable": "unavailable",
               "n/a": "n/a"}


def _f(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def _mb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f}"


def epoch_metrics(record: dict, scenario: str, epoch: str) -> dict[str, dict]:
    """Per contender: the numbers of one epoch, or its status."""
    link = (record.get("link") or {}).get("bytes_per_s")
    out: dict[str, dict] = {}
    for name, rec in (record.get("scenarios", {}).get(scenario) or {}).items():
        e = (rec.get("epochs") or {}).get(epoch)
        m: dict = {"status": rec["status"], "reason": rec.get("reason")}
        if e is None:
            if m["status"] == "ok":
                m["status"] = "n/a"
            out[name] = m
            continue
        partial = bool(e.get("timed_out"))
        m["status"] = "timeout" if partial else "ok"
        t = e["iterate_s"] or 1e-9
        first = epoch in ("cold", "epoch1")
        setup = rec.get("setup") or {}
        fetched = e.get("nginx_bytes", 0) + (setup.get("bytes", 0) if first else 0)
        requests = e.get("requests", 0) + (setup.get("requests", 0) if first else 0)
        m.update({
            "files": e["files"],
            "files_s": e["files"] / t,
            # End to end: mount/copy/index + dataset construction + the epoch itself.
            "e2e_files_s": e["files"] / (setup.get("s", 0) + e["total_s"]) if first else None,
            "mb_s": e["bytes_read"] / t / 1e6,
            "ttfb_s": e.get("ttfb_s"),
            "ttfb_from_start_s": (setup.get("s", 0) + (e.get("ttfb_s") or 0)) if first
            else None,
            "setup_s": setup.get("s") if first else None,
            "fetched": fetched,
            "amplification": fetched / e["bytes_read"] if e["bytes_read"] else None,
            "requests": requests,
            "daemon_cpu_s": e.get("daemon_cpu_s"),
            "client_cpu_s": e.get("client_cpu_s"),
            "rss": rec.get("daemon_peak_rss_bytes"),
            "of_link": (e["bytes_read"] / t / link) if link else None,
            "link_busy": (e.get("nginx_bytes", 0) / t / link) if link else None,
        })
        out[name] = m
    return out


def _best(values: list[float | None], higher: bool) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    if not vals:
        return None
    return max(vals) if higher else min(vals)


def _cell(v: float | None, best: float | None, fmt) -> str:
    if v is None:
        return "–"
    if v == 0:
        return "0"
    if best and best > 0:
        return f"{fmt(v)} ({v / best:.2f}x)"
    return fmt(v)


def epoch_table(record: dict, scenario: str, epoch: str) -> list[str]:
    ms = epoch_metrics(record, scenario, epoch)
    labels = record.get("contenders", {})
    ok = {n: m for n, m in ms.items() if m["status"] in ("ok", "timeout")}
    first = epoch in ("cold", "epoch1")
    cols = [("files_s", True, lambda v: f"{v:,.0f}", "files/s"),
            *([("e2e_files_s", True, lambda v: f"{v:,.0f}", "files/s incl. set-up")]
              if first else []),
            ("mb_s", True, lambda v: f"{v:,.1f}", "MB/s"),
            ("ttfb_from_start_s" if first else "ttfb_s", False, _f,
             "first batch s (from start)" if first else "first batch s"),
            ("amplification", False, lambda v: f"{v:.2f}", "fetched / read"),
            ("requests", False, lambda v: f"{v:,.0f}", "requests"),
            ("daemon_cpu_s", False, _f, "daemon CPU s"),
            ("client_cpu_s", False, _f, "loader CPU s"),
            ("rss", False, lambda v: f"{v / 2**20:,.0f}", "daemon peak RSS MiB")]
    bests = {k: _best([m.get(k) for m in ok.values()], hi) for k, hi, _, _ in cols}
    # Zero requests/bytes (a warm cache) is the best possible: keep ratios meaningful.
    for k in ("requests", "amplification"):
        if any(m.get(k) == 0 for m in ok.values()):
            bests[k] = None
    link = bool((record.get("link") or {}).get("bytes_per_s"))
    head = ["contender"] + [c[3] for c in cols] + (["MB/s ÷ link", "link busy"] if link else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in ms.items():
        label = labels.get(name, {}).get("label", name)
        if m["status"] not in ("ok", "timeout"):
            reason = (m.get("reason") or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label} | **{STATUS_TEXT.get(m['status'], m['status'])}**: "
                         f"{reason} |" + " |" * (len(head) - 2))
            continue
        if m["status"] == "timeout":
            label += f" (TIMEOUT: {m['files']} files)"
        cells = [label] + [_cell(m.get(k), None if m["status"] == "timeout" else bests[k], fmt)
                           for k, _, fmt, _ in cols]
        if link:
            cells += [_f(m.get("of_link")), _f(m.get("link_busy"))]
        lines.append("| " + " | ".join(cells) + " |")
    reads = []
    for name, rec in (record.get("scenarios", {}).get(scenario) or {}).items():
        e = (rec.get("epochs") or {}).get(epoch) or {}
        if e.get("daemon_reads") is not None:
            reads.append(f"{labels.get(name, {}).get('label', name)}: {e['daemon_reads']:,}")
    if reads:
        lines += ["", "FUSE reads that reached the shardfs daemon in this epoch (the rest were "
                  "served by the kernel's page cache): " + "; ".join(reads) + "."]
    return lines


def meta_table(record: dict) -> list[str]:
    res = record.get("scenarios", {}).get("meta") or {}
    labels = record.get("contenders", {})
    md = record.get("meta_dataset") or {}
    rows = {}
    for name, rec in res.items():
        e = (rec.get("epochs") or {}).get("meta")
        if rec["status"] in ("ok", "timeout") and e is not None:
            rss = rec.get("daemon_peak_rss_bytes")
            rows[name] = {"mount_s": (rec.get("setup") or {}).get("s"),
                          "find_s": e.get("find_s"),
                          "find_rate": e["find_entries"] / e["find_s"] if e.get("find_s") else None,
                          "imagefolder_s": e.get("imagefolder_s"),
                          "requests": e.get("requests", 0) + (rec.get("setup") or {}).get(
                              "requests", 0),
                          "daemon_cpu_s": e.get("daemon_cpu_s"),
                          "rss": rss,
                          "rss_now": rec.get("daemon_rss_bytes"),
                          "rss_per_file": rss / md["files"] if rss and md.get("files") else None,
                          "timeout": rec["status"] == "timeout", "entries": e.get("find_entries")}
    cols = [("mount_s", False, _f, "mount/setup s"), ("find_s", False, _f, "find s"),
            ("find_rate", True, lambda v: f"{v:,.0f}", "find entries/s"),
            ("imagefolder_s", False, _f, "ImageFolder(root) s"),
            ("requests", False, lambda v: f"{v:,.0f}", "requests"),
            ("daemon_cpu_s", False, _f, "daemon CPU s"),
            ("rss", False, lambda v: f"{v / 2**20:,.0f}", "daemon peak RSS MiB"),
            ("rss_now", False, lambda v: f"{v / 2**20:,.0f}", "daemon RSS after MiB"),
            ("rss_per_file", False, lambda v: f"{v:,.0f}", "peak RSS B/file")]
    bests = {k: _best([r.get(k) for r in rows.values() if not r["timeout"]], hi)
             for k, hi, _, _ in cols}
    if any(r.get("requests") == 0 for r in rows.values()):
        bests["requests"] = None
    head = ["contender"] + [c[3] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rec in res.items():
        label = labels.get(name, {}).get("label", name)
        if name not in rows:
            reason = (rec.get("reason") or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label} | **{STATUS_TEXT.get(rec['status'], rec['status'])}**: "
                         f"{reason} |" + " |" * (len(head) - 2))
            continue
        r = rows[name]
        if r["timeout"]:
            label += f" (TIMEOUT: {r['entries']:,} entries listed)"
        lines.append("| " + " | ".join(
            [label] + [_cell(r.get(k), None if r["timeout"] else bests[k], fmt)
                       for k, _, fmt, _ in cols]) + " |")
    return lines


def headline(record: dict) -> list[str]:
    """shardfs against each contender and the link, in plain sentences."""
    lines = []
    link = (record.get("link") or {}).get("bytes_per_s")
    labels = record.get("contenders", {})
    wanted = {("main", "cold"), ("main", "warm"), ("small", "cold"), ("over", "epoch1"),
              ("over", "epoch2")}
    for scenario, epoch, title in HEADLINE_EPOCHS:
        if (scenario, epoch) not in wanted:
            continue
        ms = epoch_metrics(record, scenario, epoch)
        s = ms.get("shardfs")
        if not s or s["status"] != "ok":
            continue
        parts = []
        for name, m in ms.items():
            if name == "shardfs" or m["status"] != "ok" or not m.get("files_s"):
                continue
            part = (f"{labels.get(name, {}).get('label', name)} "
                    f"{s['files_s'] / m['files_s']:.2f}x")
            if s.get("e2e_files_s") and m.get("e2e_files_s"):
                part += f" ({s['e2e_files_s'] / m['e2e_files_s']:.2f}x end to end)"
            parts.append(part)
        text = f"- **{title.split(' (')[0].split(',')[0]}**: shardfs {s['files_s']:,.0f} files/s"
        if link and s.get("of_link") is not None:
            text += f" = {s['of_link']:.2f}x the link rate"
        if s.get("ttfb_from_start_s") is not None:
            text += f", first batch {s['ttfb_from_start_s']:.2f} s from start"
            loc = ms.get("local")
            if loc and loc.get("ttfb_from_start_s") is not None:
                text += f" (local disk: {loc['ttfb_from_start_s']:.2f} s, copy included)"
        if s.get("amplification") is not None:
            text += f", fetched/read {s['amplification']:.2f}"
        if parts:
            text += "; shardfs vs " + ", ".join(parts)
        lines.append(text + ".")
    return lines


def render_markdown(record: dict, png_name: str | None, record_name: str | None) -> str:
    ds, link = record.get("dataset", {}), record.get("link", {})
    md = record.get("meta_dataset")
    cfg = record.get("config", {})
    out = ["# Benchmarks", "",
           "Generated by `python -m bench` from one run (`bench/report.py`; do not edit by "
           "hand). Every number below comes from that single run on one machine with the same "
           "data; compare contenders through the ratios, never absolute numbers across runs. "
           "Other work shared this machine during the run, so small differences are noise.",
           "", "Command:", "", "```", record.get("command", ""), "```", ""]
    if record_name:
        out += [f"Record: `{record_name}` (bench/out/ is not committed).", ""]
    host = record.get("host", {})
    out += [f"- **When/where**: {record.get('started')}, {host.get('cpus')} CPUs, "
            f"Linux {host.get('kernel')}, Python {host.get('python')}, torch {host.get('torch')}, "
            f"{host.get('nginx')}; run took {record.get('duration_s')} s.",
            f"- **Data**: {ds.get('files'):,} JPEGs in {ds.get('classes')} classes, mean "
            f"{ds.get('mean_kb')} KiB ({_mb(ds.get('bytes'))} MB), packed into "
            f"{ds.get('shards')} shuffled shards of ~{ds.get('shard_mb')} MiB "
            f"({_mb(ds.get('shard_bytes'))} MB) with `.shardfs.idx` files.",
            f"- **Remote store**: nginx on 127.0.0.1, {link.get('latency_ms')} ms per request "
            f"(echo_sleep, non-blocking); link: {link.get('cap')}"
            + (f" = {link['bytes_per_s'] / 1e6:.0f} MB/s" if link.get("bytes_per_s") else "")
            + ".",
            f"- **Loop**: `ImageFolder` + `DataLoader(shuffle=True, num_workers="
            f"{cfg.get('workers')}, batch_size={cfg.get('batch_size')})`, each file read fully "
            "(raw bytes); the decode epoch uses torchvision's default PIL loader. Each epoch runs "
            "in a fresh process.",
            f"- **Cache sizes** (shardfs `--cache-size`): "
            f"{_mb(record.get('cache_sizes', {}).get('main'))} MB "
            f"when the dataset fits, {_mb(record.get('cache_sizes', {}).get('over'))} MB for "
            "the ~4x scenario."]
    sd = record.get("small_dataset")
    if sd:
        out.append(f"- **Small-file data**: {sd['files']:,} JPEGs, mean {sd['mean_kb']} KiB "
                   f"({_mb(sd['bytes'])} MB) in {sd['shards']} shards of ~{sd['shard_mb']} MiB.")
    if md:
        out.append(f"- **Metadata data**: one tar of {md['files']:,} zero-byte members in "
                   f"{md['dirs']:,} directories ({_mb(md['tar_bytes'])} MB)"
                   + (", plus the same tree as loose files" if md.get("loose") else "") + ".")
    out.append("")
    hl = headline(record)
    if hl:
        out += ["## Headline", "", *hl, ""]
    if png_name:
        out += [f"![benchmark chart]({png_name})", ""]
    out += ["## How to read the tables", "",
            "- Throughput is over the epoch's iteration (after the dataset object is built); "
            "`first batch` includes building the dataset (ImageFolder's walk). On the first "
            "epoch it is counted **from the start**: mount, index or copy time included, and "
            "`files/s incl. set-up` divides the files by set-up + dataset construction + epoch "
            "(what a user waits for: e.g. ratarmount downloads the shards while indexing at "
            "mount, local disk copies everything first).",
            "- `(N.NNx)` after a value is its ratio to the best contender in the same table "
            "(1.00x = best; above 1 is worse for costs, below 1 is worse for throughput).",
            "- `fetched / read`: bytes nginx sent during the epoch (plus set-up on the first "
            "epoch: copy, index) over bytes the loop read. `requests`: nginx access-log lines, "
            "counted the same way.",
            "- `MB/s ÷ link`: useful bytes per second over the bandwidth cap; `link busy`: bytes "
            "actually sent by nginx per second over the cap.",
            "- `daemon CPU`: utime+stime of the FUSE daemon during the epoch (/proc/PID/stat); "
            "`loader CPU`: the epoch process and its DataLoader workers (wait4 rusage). "
            "`daemon peak RSS`: VmHWM of the daemon.",
            "- A contender that failed, timed out, or is not available is shown as such, with "
            "its error.",
            "- Method notes: the local-disk cold epoch runs after `posix_fadvise(DONTNEED)` on "
            "every copied file; warm epochs on FUSE mounts may be served by the kernel's page "
            "cache (shardfs sets `keep_cache`; the daemon's own read count is given under each "
            "table); rclone's http remote HEADs every file while listing, so its first "
            "`ImageFolder` walk costs one request per file; ratarmount indexes the shards over "
            "HTTP at mount time (its set-up bytes) and serves what fsspec kept from that; wids "
            "and webdataset fetch shards with curl.", ""]
    for scenario, epoch, title in HEADLINE_EPOCHS:
        if scenario not in record.get("scenarios", {}):
            continue
        out += [f"## {title}", "", *epoch_table(record, scenario, epoch), ""]
    if "meta" in record.get("scenarios", {}):
        out += [f"## Metadata only: {SCENARIO_TITLES['meta'].split(': ', 1)[1]}", "",
                "Mount (or index) first, then `find ROOT` on the fresh mount, then "
                "`ImageFolder(ROOT/train)` (after find, so kernel caches may help every "
                "contender alike). Local disk reads a loose tree written just before.", ""]
        out += [*meta_table(record), ""]
    out += ["## Contenders", ""]
    for c in record.get("contenders", {}).values():
        ver = f" ({c['version']})" if c.get("version") else ""
        out.append(f"- **{c['label']}**{ver}: {c['how']}")
    out.append("")
    notes = []
    for scenario, res in record.get("scenarios", {}).items():
        for name, rec in res.items():
            for n in rec.get("notes", []):
                notes.append(f"- {scenario}/{name}: {n}")
    if notes:
        out += ["## Notes from the run", "", *notes, ""]
    out += ["## Earlier investigations", "",
            "Dated measurements behind design decisions (each with its own command and the code "
            "of its day) are in [benchmarks-notes.md](benchmarks-notes.md).", ""]
    return "\n".join(out)


def render_png(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s, e, t) for s, e, t in HEADLINE_EPOCHS
              if s in record.get("scenarios", {}) and e != "decode"
              and (s, e) != ("small", "warm")]
    labels = record.get("contenders", {})
    n = len(panels) + (1 if "meta" in record.get("scenarios", {}) else 0)
    cols = 2
    rows = max(1, -(-n // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.6 * rows), dpi=80, squeeze=False)
    flat = list(axes.flat)
    for ax, (scenario, epoch, title) in zip(flat, panels, strict=False):
        ms = epoch_metrics(record, scenario, epoch)
        names = list(ms)
        vals = [ms[k].get("files_s") or 0 for k in names]
        colors = ["#d62728" if k.startswith("shardfs") else "#7f7f7f" for k in names]
        y = range(len(names))
        ax.barh(y, vals, color=colors)
        ax.set_yticks(list(y), [labels.get(k, {}).get("label", k) for k in names], fontsize=8)
        ax.invert_yaxis()
        top = max(vals) if any(vals) else 1
        for i, k in enumerate(names):
            m = ms[k]
            text = f"{m['files_s']:,.0f}" if m.get("files_s") else \
                STATUS_TEXT.get(m["status"], m["status"])
            if m["status"] == "timeout":
                text += " (timeout)"
            ax.text((m.get("files_s") or 0) + top * 0.01, i, text, va="center", fontsize=7)
        ax.set_xlim(0, top * 1.3)
        ax.set_title(PANEL_TITLES.get((scenario, epoch), title) + " — files/s", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    if "meta" in record.get("scenarios", {}):
        ax = flat[len(panels)]
        res = record["scenarios"]["meta"]
        names = list(res)
        vals = []
        texts = []
        for k in names:
            e = (res[k].get("epochs") or {}).get("meta") or {}
            v = e.get("find_s") if res[k]["status"] == "ok" else None
            vals.append(v or 0)
            if v:
                texts.append(f"{v:.2f} s")
            elif res[k]["status"] == "timeout":
                texts.append(f"TIMEOUT (> {e.get('find_s', 0):.0f} s, "
                             f"{e.get('find_entries', 0):,} entries)")
            else:
                texts.append(STATUS_TEXT.get(res[k]["status"], res[k]["status"]))
        y = range(len(names))
        ax.barh(y, vals, color=["#d62728" if k.startswith("shardfs") else "#7f7f7f"
                                for k in names])
        ax.set_yticks(list(y), [labels.get(k, {}).get("label", k) for k in names], fontsize=8)
        ax.invert_yaxis()
        top = max(vals) if any(vals) else 1
        for i, t in enumerate(texts):
            ax.text(vals[i] + top * 0.01, i, t, va="center", fontsize=7)
        ax.set_xlim(0, top * 1.3)
        files = (record.get("meta_dataset") or {}).get("files", 0)
        ax.set_title(f"find over {files:,} files — seconds (lower is better)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    for ax in flat[n:]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def write_docs(record: dict, md_path: Path, png_path: Path | None = None,
               record_path: Path | None = None) -> tuple[Path, Path | None]:
    """Write the page and its chart; without matplotlib (the `bench` extra) the page only."""
    png_path = png_path or md_path.with_suffix(".png")
    try:
        render_png(record, png_path)
        rel: str | None = os.path.relpath(png_path, md_path.parent)
    except ImportError:
        rel, png_path = None, None
    md_path.parent.mkdir(parents=True, exist_ok=True)
    kept = kept_sections(md_path.read_text()) if md_path.exists() else []
    md_path.write_text(render_markdown(record, rel, record_path.name if record_path else None)
                       + "".join("\n" + block + "\n" for block in kept))
    return md_path, png_path


def kept_sections(text: str) -> list[str]:
    """The blocks other commands generate into the same page (`<!-- NAME: begin -->` ...
    `<!-- NAME: end -->`: `bench s3`, `bench node`), kept when this page is regenerated."""
    blocks = []
    while "<!-- " in text:
        start = text.index("<!-- ")
        name = text[start + 5:].split(":", 1)[0]
        begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
        if not text.startswith(begin, start) or end not in text[start:]:
            text = text[start + 5:]
            continue
        stop = text.index(end, start) + len(end)
        blocks.append(text[start:stop])
        text = text[stop:]
    return blocks


def summary_lines(record: dict) -> list[str]:
    """A compact terminal summary: files/s per contender per epoch, and statuses."""
    lines = ["", "summary (files/s; status):"]
    for scenario, epoch, _ in HEADLINE_EPOCHS:
        if scenario not in record.get("scenarios", {}):
            continue
        ms = epoch_metrics(record, scenario, epoch)
        cells = []
        for name, m in ms.items():
            if m.get("files_s"):
                cells.append(f"{name} {m['files_s']:,.0f}"
                             + (" (timeout)" if m["status"] == "timeout" else ""))
            else:
                cells.append(f"{name} {m['status']}")
        lines.append(f"  {scenario}/{epoch}: " + ", ".join(cells))
    if "meta" in record.get("scenarios", {}):
        cells = []
        for name, rec in record["scenarios"]["meta"].items():
            e = (rec.get("epochs") or {}).get("meta")
            cells.append(f"{name} find {e['find_s']:.2f}s" if e and rec["status"] == "ok"
                         else f"{name} {rec['status']}")
        lines.append("  meta: " + ", ".join(cells))
    return lines


def report_command(args) -> int:
    path = Path(args.record)
    record = json.loads(path.read_text())
    md, png = write_docs(record, Path(args.docs), Path(args.png) if args.png else None,
                         record_path=path)
    print(f"wrote {md}" + (f" and {png}" if png else " (no chart: matplotlib missing)"))
    return 0
