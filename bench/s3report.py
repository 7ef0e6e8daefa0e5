"""The `s3` scenario's section of docs/benchmarks.md, from one `python -m bench s3` record:
per epoch, each contender's median over the rounds with the range, and the ratio to the best
peer (shardfs's contenders and Ray-on-shardfs are not peers)."""

from __future__ import annotations

import statistics
from pathlib import Path

MARK_BEGIN = "<!-- s3 scenario: begin -->"
MARK_END = "<!-- s3 scenario: end -->"
H100_SAMPLES_S = 1786  # MLPerf Storage: ResNet-50 samples/s one H100 asks for
EPOCH_TITLES = {
    ("s3", "cold"): "Cold epoch (every cache emptied: fresh mount, cache dirs and wids/litdata/"
                    "Streaming caches)",
    ("s3", "warm"): "Warm epoch (second epoch, same mount and caches)",
    ("s3-over", "epoch1"): "Dataset 4x the cache: first epoch",
    ("s3-over", "epoch2"): "Dataset 4x the cache: second epoch (FUSE mounts remounted between)",
}
OURS = ("shardfs", "shardfs-sampler", "shardfs-lookahead", "ray-shardfs")


def _runs(record: dict, scenario: str, epoch: str, name: str) -> list[tuple[dict, dict]]:
    """(contender record, epoch record) of every round where this epoch completed."""
    out = []
    for rnd in record.get("rounds", []):
        rec = (rnd.get("scenarios", {}).get(scenario) or {}).get(name)
        if rec and rec.get("status") == "ok" and epoch in (rec.get("epochs") or {}):
            out.append((rec, rec["epochs"][epoch]))
    return out


def _status(record: dict, scenario: str, name: str) -> tuple[str, str]:
    for rnd in record.get("rounds", []):
        rec = (rnd.get("scenarios", {}).get(scenario) or {}).get(name)
        if rec and rec.get("status") != "ok":
            return rec["status"], (rec.get("reason") or "")
    return "n/a", "not run"


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _range(values: list[float], fmt: str = "{:,.0f}") -> str:
    if not values:
        return "–"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def epoch_rows(record: dict, scenario: str, epoch: str) -> dict[str, dict]:
    first = epoch in ("cold", "epoch1")
    rows = {}
    for name in record.get("contenders", {}):
        runs = _runs(record, scenario, epoch, name)
        if not runs:
            continue
        rate = [e["files"] / e["iterate_s"] for _, e in runs if e["iterate_s"] > 0]
        setup_s = [rec["setup"]["s"] for rec, _ in runs] if first else []
        ttfb = [(rec["setup"]["s"] if first else 0) + (e.get("ttfb_s") or 0) for rec, e in runs]
        fetched = [e["nginx_bytes"] + (rec["setup"]["bytes"] if first else 0) for rec, e in runs]
        reqs = [e["requests"] + (rec["setup"]["requests"] if first else 0) for rec, e in runs]
        rows[name] = {
            "rate": rate, "setup_s": setup_s, "ttfb": ttfb,
            "fetched_per_read": [f / e["bytes_read"] for f, (_, e) in zip(fetched, runs,
                                                                          strict=True)
                                 if e["bytes_read"]],
            "requests": reqs,
            "loader_cpu": [e.get("iterate_cpu_s") or 0 for _, e in runs],
            "daemon_cpu": [(e.get("daemon_cpu_s") or 0) + (e.get("workers_cpu_s") or 0)
                           for _, e in runs],
            "server_cpu": [e.get("server_cpu_s") or 0 for _, e in runs],
            "daemon_rss": [rec.get("daemon_peak_rss_bytes") or 0 for rec, _ in runs],
            "loader_rss": [e.get("client_maxrss_bytes") or 0 for _, e in runs],
            "timed_out": any(e.get("timed_out") for _, e in runs),
            "n": len(runs),
        }
    return rows


def epoch_table(record: dict, scenario: str, epoch: str) -> list[str]:
    rows = epoch_rows(record, scenario, epoch)
    labels = record.get("contenders", {})
    link = (record.get("link") or {}).get("bytes_per_s")
    mean_size = (record.get("dataset") or {}).get("bytes", 0) / max(
        1, (record.get("dataset") or {}).get("files", 1))
    peers = {n: _med(r["rate"]) for n, r in rows.items() if n not in OURS and r["rate"]}
    best_peer = max(peers.values()) if peers else None
    first = epoch in ("cold", "epoch1")
    head = ["contender", "files/s", "x best peer", "H100s fed"]
    if link:
        head.append("link share")
    head += ["first batch s" + (" (from start)" if first else "")]
    if first:
        head.append("set-up s")
    head += ["fetched / read", "requests", "loader CPU s", "daemon CPU s", "server CPU s",
             "daemon peak RSS MiB", "loader peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in record.get("contenders", {}):
        label = labels[name]["label"]
        r = rows.get(name)
        if r is None:
            status, reason = _status(record, scenario, name)
            reason = reason.replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label} | **{status}**: {reason} |" + " |" * (len(head) - 2))
            continue
        med = _med(r["rate"]) or 0
        cells = [label + (" (TIMEOUT)" if r["timed_out"] else ""), _range(r["rate"]),
                 f"{med / best_peer:.2f}x" if best_peer else "–",
                 f"{med / H100_SAMPLES_S:.2f}"]
        if link:
            cells.append(f"{med * mean_size / link:.2f}")
        cells.append(_range(r["ttfb"], "{:.2f}"))
        if first:
            cells.append(_range(r["setup_s"], "{:.2f}"))
        cells += [_range(r["fetched_per_read"], "{:.2f}"), _range(r["requests"]),
                  _range(r["loader_cpu"], "{:.1f}"), _range(r["daemon_cpu"], "{:.1f}"),
                  _range(r["server_cpu"], "{:.1f}"),
                  _range([v / 2**20 for v in r["daemon_rss"] if v]),
                  _range([v / 2**20 for v in r["loader_rss"] if v])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _medians(record: dict, scenario: str, epoch: str) -> dict[str, float]:
    return {n: m for n, r in epoch_rows(record, scenario, epoch).items()
            if (m := _med(r["rate"])) is not None}


def target_lines(record: dict) -> list[str]:
    """Issue 33's targets, as ratios of this record's medians (met or missed, by how much)."""
    labels = {n: c["label"] for n, c in record.get("contenders", {}).items()}
    out = []

    def best_peer(m: dict[str, float]) -> tuple[str, float] | None:
        peers = {n: v for n, v in m.items() if n not in OURS}
        return max(peers.items(), key=lambda kv: kv[1]) if peers else None

    def line(what: str, ours: str | None, m: dict[str, float], goal: float,
             against: tuple[str, float] | None) -> None:
        if ours is None or ours not in m or against is None:
            return
        ratio = m[ours] / against[1]
        verdict = "met" if ratio >= goal else f"missed by {(goal - ratio) / goal:.0%}"
        out.append(f"- {what}: {labels[ours]} {m[ours]:,.0f} files/s = {ratio:.2f}x "
                   f"{labels[against[0]]} ({against[1]:,.0f}); target >= {goal:g}x: "
                   f"**{verdict}**.")

    cold = _medians(record, "s3", "cold")
    bp = best_peer(cold)
    fast = max((n for n in ("shardfs-lookahead", "shardfs-sampler") if n in cold),
               key=lambda n: cold[n], default=None)
    line("Cold epoch, the better of Lookahead / ShardAwareSampler", fast, cold, 1.0, bp)
    line("Cold epoch, stock `shuffle=True`", "shardfs", cold, 0.85, bp)
    warm = _medians(record, "s3", "warm")
    for peer in [n for n in warm if n not in OURS]:
        line("Warm epoch", "shardfs", warm, 0.9, (peer, warm[peer]))
    over = _medians(record, "s3-over", "epoch1")
    line("Dataset 4x the cache, first epoch, Lookahead", "shardfs-lookahead", over, 0.9,
         best_peer(over))
    over2 = _medians(record, "s3-over", "epoch2")
    line("Dataset 4x the cache, second epoch, Lookahead", "shardfs-lookahead", over2, 0.9,
         best_peer(over2))
    return out


def render_section(record: dict, record_name: str | None) -> str:
    ds, link, cfg = record.get("dataset", {}), record.get("link", {}), record.get("config", {})
    conv = record.get("conversions", {})
    rounds = len(record.get("rounds", []))
    out = [MARK_BEGIN, "", "## From an S3 server: shardfs beside litdata, MosaicML Streaming, "
           "webdataset, wids and Ray Data", "",
           "Generated by `python -m bench s3` (bench/s3bench.py, bench/s3report.py; do not edit "
           "by hand); the command(s):", "", "```", record.get("command", ""), "```", ""]
    if record_name:
        out += [f"Record(s): `{record_name}` (bench/out/ is not committed).", ""]
    conv_text = "; ".join(f"{k} {v['s']:.1f} s ({v['files']} files, {v['bytes'] / 1e6:.1f} MB)"
                          for k, v in conv.items())
    out += [
        f"- **When/where**: {record.get('started')}, {record.get('host', {}).get('cpus')} CPUs; "
        f"{rounds} round(s), contenders in turns (the order rotated each round); run took "
        f"{record.get('duration_s')} s. Cells: median over the rounds [min–max].",
        f"- **Data**: {ds.get('files'):,} JPEGs of mean {ds.get('mean_kb')} KiB "
        f"({ds.get('bytes', 0) / 1e6:.1f} MB) as {ds.get('shards')} tar shards of "
        f"~{ds.get('shard_mb')} MiB (+ `.shardfs.idx`), as loose objects (Ray Data), as litdata "
        "chunks and as MDS shards of the same target size, all in one bucket. Conversion "
        f"(once, cached between runs): {conv_text or 'none'}; upload "
        f"{record.get('upload_s', 0):.1f} s (not through the link).",
        f"- **Store**: SeaweedFS (`weed server`, SigV4 checked, reader keys with Read/List) "
        f"behind an nginx proxy adding {link.get('latency_ms')} ms per request (echo_sleep, "
        f"non-blocking); link: {link.get('cap')}"
        + (f" = {link['bytes_per_s'] / 1e6:.0f} MB/s" if link.get("bytes_per_s") else "")
        + ". Requests and bytes: the proxy's access log; `server CPU`: SeaweedFS + the proxy.",
        f"- **Loop**: raw bytes, batch {cfg.get('batch_size')}, {cfg.get('workers')} loader "
        "workers (DataLoader `num_workers`; Ray: `num_cpus`); each epoch in a fresh process. "
        "`H100s fed`: files/s / 1,786 (MLPerf Storage's ResNet-50 samples/s per H100). "
        "`link share`: useful bytes/s over the cap. `x best peer`: files/s over the best of "
        "litdata, Streaming, webdataset, wids and Ray-from-S3.",
        f"- **Cache sizes**: {record.get('cache_sizes', {}).get('s3', 0) / 1e6:.0f} MB "
        f"(fits); {record.get('cache_sizes', {}).get('s3-over', 0) / 1e6:.1f} MB in the 4x "
        "scenario (shardfs `--cache-size`, litdata `max_cache_size`, Streaming `cache_limit`).",
        ""]
    proxy = [e.get("proxy_cpu_s") for rnd in record.get("rounds", [])
             for res in rnd.get("scenarios", {}).values() for rec in res.values()
             for e in (rec.get("epochs") or {}).values() if e.get("proxy_cpu_s") is not None]
    if proxy:
        used = _range(proxy, "{:.2f}")
        out += [f"The latency proxy (nginx, its own processes) used {used} CPU s per epoch"
                " (median [min–max] over every epoch), part of `server CPU`; none of it "
                "is in the loader's or the daemon's columns.", ""]
    targets = target_lines(record)
    if targets:
        out += ["### Targets (issue 33), from the medians below", "", *targets, "",
                "Where the gaps come from, measured, and the next steps: "
                "[benchmarks-notes.md](benchmarks-notes.md), \"Peers from an S3 server: where "
                "the gaps are\".", ""]
    for (scenario, epoch), title in EPOCH_TITLES.items():
        if not any(scenario in rnd.get("scenarios", {}) for rnd in record.get("rounds", [])):
            continue
        out += [f"### {title}", "", *epoch_table(record, scenario, epoch), ""]
    out += ["### How each contender was set up", ""]
    for c in record.get("contenders", {}).values():
        ver = f" ({c['version']})" if c.get("version") else ""
        out.append(f"- **{c['label']}**{ver}: {c['how']}")
    out += ["", MARK_END]
    return "\n".join(out)


def write_section(page: Path, record: dict, record_name: str | None) -> None:
    """Replace the page's s3 section (between the markers), or append it."""
    section = render_section(record, record_name)
    text = page.read_text() if page.exists() else ""
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)


def merge_records(records: list[dict]) -> dict:
    """Records of several `bench s3` runs of one configuration (e.g. the 4x scenario or Ray in
    a run of their own) as one: their rounds side by side, every contender, each command."""
    merged = dict(records[0])
    merged["rounds"] = [rnd for r in records for rnd in r.get("rounds", [])]
    merged["contenders"] = {k: v for r in records for k, v in r.get("contenders", {}).items()}
    if len(records) > 1:
        merged["command"] = "\n".join(r.get("command", "") for r in records)
        merged["duration_s"] = round(sum(r.get("duration_s", 0) for r in records), 1)
    return merged


def report_command(args) -> int:
    """`python -m bench s3-report RECORD... --docs PAGE`."""
    import json

    records = [json.loads(Path(p).read_text()) for p in args.records]
    write_section(Path(args.docs), merge_records(records),
                  ", ".join(Path(p).name for p in args.records))
    print(f"wrote the s3 section of {args.docs}")
    return 0


def summary_lines(record: dict) -> list[str]:
    lines = ["", "summary (median files/s over rounds):"]
    for scenario, epoch in EPOCH_TITLES:
        rows = epoch_rows(record, scenario, epoch)
        if not rows:
            continue
        cells = [f"{n} {_med(r['rate']) or 0:,.0f}" for n, r in rows.items()]
        lines.append(f"  {scenario}/{epoch}: " + ", ".join(cells))
    for name in record.get("contenders", {}):
        for rnd in record.get("rounds", []):
            for scenario, res in rnd.get("scenarios", {}).items():
                rec = res.get(name) or {}
                if rec.get("status") not in (None, "ok"):
                    lines.append(f"  {scenario}/{name}: {rec['status']}: "
                                 f"{(rec.get('reason') or '')[:200]}")
    return lines
