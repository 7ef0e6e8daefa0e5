"""`shardfs top [MOUNTPOINT...]`: a live view of what mounts are doing, refreshed each second.

A terminal gets a full-screen view (stdlib curses: it reads keys, handles resizes and gives
the terminal back as it found it, also after Ctrl-C or an error; no extra dependency);
a pipe, a dumb or a narrow terminal get one plain `key=value` line per mount per refresh;
`--json` one JSON object per refresh. With no MOUNTPOINT, every shardfs mount of the machine,
including those mounted later. A mount that goes away stays listed as gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

from shardfs.cli.topdata import MountWatch
from shardfs.daemon.mountpoint import FSTYPE, mounted_fstype, shardfs_mounts

SPARK = "▁▂▃▄▅▆▇█"
MIN_WIDTH = 72  # narrower terminals get plain lines


def configure_top_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoints", nargs="*", metavar="MOUNTPOINT",
                   help="shardfs mounts to watch (default: all, also those mounted later)")
    p.add_argument("-n", "--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes (default 1)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per refresh on stdout, for scripts")
    p.add_argument("--plain", action="store_true",
                   help="plain lines even on a terminal (the default for pipes)")
    p.add_argument("--count", type=int, metavar="N",
                   help="stop after N refreshes (default: until q, Ctrl-C or SIGTERM)")
    p.add_argument("--no-page-cache", action="store_true",
                   help="do not watch the mounts' directories with inotify (then files read "
                   "from the page cache are not counted)")


# -- formatting ----------------------------------------------------------------------------
def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def sparkline(values: list[float], width: int) -> str:
    values = values[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def uptime(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def block(w: MountWatch, width: int) -> list[str]:
    """The lines of one mount in the full-screen view."""
    if w.state != "ok" or w.last is None:
        what = {"gone": "GONE", "stalled": "NOT ANSWERING", "starting": "starting",
                "denied": "NO ACCESS"}[w.state]
        return [f"{w.mountpoint}  {what}" + (f": {w.reason}" if w.reason else "")]
    s, r = w.last, w.rates
    head = (f"{w.mountpoint}  pid {s.get('pid')}  up {uptime(s.get('uptime_s', 0))}  "
            f"workers {s.get('worker_count', 0)}  shim {'on' if s.get('shim') else 'OFF'}  "
            f"{s.get('shards_cached', 0)}/{s.get('shards', 0)} shards cached"
            + (f" ({s['shards_in_place']} read in place)" if s.get("shards_in_place") else ""))
    if not r:
        return [head, "  (measuring...)"]
    spark_w = max(0, min(30, width - 62))
    files = "-" if r["files_per_s"] is None else f"{r['files_per_s']:.0f}"
    peak = r["link_peak_bps"] or 0
    link = f" of {mib(peak)} peak ({100 * r['fetch_bps'] / peak:.0f}%)" if peak else ""
    lines = [
        head,
        f"  read     {files:>7} files/s {mib(r['read_bps']):>8} MiB/s  page cache "
        f"{mib(r['page_cache_bps'])}, daemon {mib(r['daemon_bps'])} "
        f"({r['daemon_reads_per_s']:.0f} reads/s, {r['reads_in_c_per_s']:.0f} in C)",
        f"  fetch    {mib(r['fetch_bps']):>8} MiB/s{link}; in flight: "
        f"{r['shard_fetches']} shard fetches, {r['member_fetches']} member GETs",
        f"  waiting  {r['reads_waiting']} reads, oldest {r['oldest_wait_s']:.2f} s",
        f"  cache    {size(r['cache_used_bytes'])} of {size(r['cache_budget_bytes'])}, "
        f"{r['evictions_per_s']:.1f} evictions/s; hit ratio {pct(r['hit_ratio_now'])} now, "
        f"{pct(r['hit_ratio'])} overall",
        f"  cpu      daemon {100 * r['cpu_daemon']:.0f}%, workers "
        f"{100 * r['cpu_workers']:.0f}% ({r['workers']})"
        + ("" if r["lookahead_bytes"] is None else
           f"; lookahead {size(r['lookahead_bytes'])} of {size(r['lookahead_budget'])}"),
        f"  errors   {r['retries_per_s']:.1f} retries/s; {r['errors']} request errors, "
        f"{r['fetch_errors']} failed fetches, {r['eio']} EIO",
    ]
    if spark_w:
        for i, key in ((1, "files" if r["files_per_s"] is not None else "read"),
                       (2, "fetched")):
            line = lines[i][:width - spark_w - 2]
            lines[i] = line.ljust(width - spark_w - 1) + \
                sparkline(list(w.history[key]), spark_w)
    note = w.page_cache_note()
    if note:
        lines.append(f"  note     {note}")
    signed = w.signature_note()
    if signed:
        lines.append(f"  signed   {signed}")
    return lines


def plain_line(w: MountWatch) -> str:
    stamp = time.strftime("%H:%M:%S")
    if w.state != "ok":
        return f"{stamp} {w.mountpoint} state={w.state}" + (f" reason={w.reason!r}"
                                                            if w.reason else "")
    r = w.rates
    if not r:
        return f"{stamp} {w.mountpoint} state=measuring"
    files = "-" if r["files_per_s"] is None else f"{r['files_per_s']:.0f}"
    return (f"{stamp} {w.mountpoint} files/s={files} read_MiBps={mib(r['read_bps'])} "
            f"page_cache_MiBps={mib(r['page_cache_bps'])} daemon_MiBps={mib(r['daemon_bps'])} "
            f"fetch_MiBps={mib(r['fetch_bps'])} link_peak_MiBps={mib(r['link_peak_bps'])} "
            f"fetches={r['shard_fetches']}+{r['member_fetches']} "
            f"waiting={r['reads_waiting']} oldest_s={r['oldest_wait_s']:.2f} "
            f"cache={size(r['cache_used_bytes'])}/{size(r['cache_budget_bytes'])} "
            f"evictions/s={r['evictions_per_s']:.1f} hit={pct(r['hit_ratio_now'])} "
            f"cpu_daemon={100 * r['cpu_daemon']:.0f}% cpu_workers={100 * r['cpu_workers']:.0f}% "
            f"retries/s={r['retries_per_s']:.1f} errors={r['errors']} eio={r['eio']}"
            )


# -- the loop ------------------------------------------------------------------------------
class Top:
    def __init__(self, args: argparse.Namespace) -> None:
        self.explicit = [os.path.abspath(m) for m in args.mountpoints]
        self.count_opens = not args.no_page_cache
        self.watches: dict[str, MountWatch] = {}
        self.timeout = min(2.0, max(0.2, args.interval))  # seconds to wait for the daemons

    def refresh(self) -> list[MountWatch]:
        wanted = self.explicit or shardfs_mounts()
        for path in wanted:
            if path not in self.watches or (self.watches[path].state == "gone"
                                            and mounted_fstype(path) == FSTYPE):
                # A mount that came (back) at this path is watched afresh.
                old = self.watches.get(path)
                if old is not None:
                    old.close()
                self.watches[path] = MountWatch(path, count_opens=self.count_opens)
        watches = list(self.watches.values())
        for w in watches:  # all at once: a mount that hangs costs one wait, not one each
            w.begin()
        deadline = time.monotonic() + self.timeout
        for w in watches:
            w.finish(deadline)
        return watches

    def close(self) -> None:
        for w in self.watches.values():
            w.close()


def _interactive(out: TextIO) -> bool:
    term = os.environ.get("TERM", "")
    if not out.isatty() or term in ("", "dumb"):
        return False
    try:
        return os.get_terminal_size(out.fileno()).columns >= MIN_WIDTH
    except OSError:
        return False


def run_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("shardfs: error: --interval must be above 0", file=sys.stderr)
        return 1
    for m in args.mountpoints:
        if not os.path.isdir(m):
            print(f"shardfs: error: {m} is not a directory", file=sys.stderr)
            return 1
    top = Top(args)
    signal.signal(signal.SIGTERM, _stop)  # like Ctrl-C: the terminal is given back
    try:
        if args.json or args.plain or not _interactive(sys.stdout):
            return _stream(top, args)
        return _screen(top, args)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `shardfs top --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        top.close()


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stream(top: Top, args: argparse.Namespace) -> int:
    n = 0
    while True:
        next_at = time.monotonic() + args.interval
        watches = top.refresh()
        if args.json:
            print(json.dumps({"time": round(time.time(), 3),
                              "mounts": [w.record() for w in watches]}), flush=True)
        else:
            for w in watches:
                print(plain_line(w), flush=True)
            if not watches:
                print(f"{time.strftime('%H:%M:%S')} no shardfs mounts", flush=True)
        n += 1
        if args.count is not None and n >= args.count:
            return 0
        time.sleep(max(0.0, next_at - time.monotonic()))


def _screen(top: Top, args: argparse.Namespace) -> int:
    import curses

    def main(screen: Any) -> int:
        with contextlib.suppress(curses.error):  # a terminal that cannot hide it
            curses.curs_set(0)
        screen.timeout(100)  # ms: keys are read between refreshes
        n = 0
        next_at = 0.0
        while True:
            now = time.monotonic()
            if now >= next_at:
                watches = top.refresh()
                _draw(screen, watches, args.interval)
                n += 1
                next_at = now + args.interval
                if args.count is not None and n >= args.count:
                    return 0
            key = screen.getch()
            if key in (ord("q"), ord("Q"), 27):
                return 0

    return curses.wrapper(main)


def _draw(screen: Any, watches: list[MountWatch], interval: float) -> None:
    import curses

    height, width = screen.getmaxyx()
    screen.erase()
    lines = [f"shardfs top - {len(watches)} mount(s) - {time.strftime('%H:%M:%S')} - every "
             f"{interval:g} s - q quits", ""]
    if not watches:
        lines.append("no shardfs mounts (waiting for one)")
    for w in watches:
        lines.extend(block(w, width))
        lines.append("")
    for y, line in enumerate(lines[:height]):
        attr = curses.A_BOLD if y == 0 else curses.A_NORMAL
        with contextlib.suppress(curses.error):  # the bottom-right cell, or a resize
            screen.addnstr(y, 0, line, width - 1, attr)
    screen.refresh()
