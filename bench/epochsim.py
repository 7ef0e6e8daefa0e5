"""A model of the cold shuffled epoch: how close to the link can `shuffle=True` get?

`python -m bench.epochsim` steps a model of bench's cold scenario at `--scale 3`
(3,000 files of 50-175 KB in ~12 MB shards, 100 MB/s, 20 ms per request, a DataLoader of 4
workers reading batches of 32 one file at a time, ~0.6 ms a file once its bytes are in)
under fetch policies that shardfs has or could have, and prints each one's epoch as a
fraction of the link time T (all bytes once at the link rate). It checks ideas before they
are built (docs/benchmarks-notes.md, "What a model of the epoch says about priority"); it measures
nothing about the real daemon.

Policies:
- `streams`: today's reader (shardfs/read/reader.py): up to `slots` whole-shard GETs sharing
  the link fairly, started in the order shards are first read; a read whose bytes are far or
  whose shard waits for a slot fetches its member if the duplicate bytes stay under `budget`.
- `streams-prio`: the same, but the link goes only to shards a reader is waiting on, and the
  switch is instant (no request latency, no bytes already in flight): the ideal of priority.
- `streams`, members not fetched twice (`skip`): a member read ahead of its shard's GET is
  not fetched again: the GET ends at the member and a new GET asks for the rest when the
  first gets there (one request latency lost each time).
- `split` (shardfs/read/reader.py `_split`, `--split-fetches on`): as `skip`, but the new
  GET is asked at once, when the member read is, so no GET waits: the bytes of a shard arrive
  in runs (the part file holds them out of order, read/fetch.py). The model leaves out the
  bytes a GET cut short has in flight past its new end; on a real mount they made it 1.27x
  the bytes and no faster (docs/benchmarks-notes.md), so the reader does not split by default.
- `chunks`, `chunks-prio`: ranged GETs of `chunk` bytes, `inflight` at once, each paying the
  request latency; `-prio` asks first for the next chunk of a shard a reader waits on. This is
  how priority could really be built over HTTP.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Setup:
    files: int = 3000
    shard_bytes: float = 12.1e6  # --scale 3: 338 MB in 28 shards
    link: float = 100e6  # bytes/s
    latency: float = 0.02  # s from a request to its first byte
    read_cost: float = 0.0006  # s a DataLoader worker spends on a file whose bytes are in
    workers: int = 4
    batch: int = 32
    prefetch: int = 2  # batches a worker may run ahead (DataLoader's prefetch_factor)
    step: float = 0.0002  # s per model step


@dataclass
class Result:
    epoch: float
    link_time: float
    first_batch: float
    read_by_link_time: int
    fetched_over_read: float
    requests: int

    @property
    def x_link(self) -> float:
        return self.link_time / self.epoch


class Model:
    """Files packed in shards, a shuffled order of batches, and the DataLoader's workers."""

    def __init__(self, setup: Setup, seed: int) -> None:
        rng = random.Random(seed)
        self.s = setup
        sizes = [rng.uniform(50e3, 175e3) for _ in range(setup.files)]
        packing = list(range(setup.files))
        rng.shuffle(packing)
        self.where: dict[int, tuple[int, float, float]] = {}  # file -> shard, start, end
        self.shard_len: list[float] = []
        for f in packing:
            if not self.shard_len or self.shard_len[-1] >= setup.shard_bytes:
                self.shard_len.append(0.0)
            s = len(self.shard_len) - 1
            self.where[f] = (s, self.shard_len[s], self.shard_len[s] + sizes[f])
            self.shard_len[s] += sizes[f]
        self.sizes = sizes
        self.total = sum(self.shard_len)
        order = list(range(setup.files))
        rng.shuffle(order)
        self.batches = [order[i:i + setup.batch] for i in range(0, setup.files, setup.batch)]
        w = setup.workers
        self.todo = [list(range(k, len(self.batches), w)) for k in range(w)]
        self.pos = [0] * w
        self.index = [0] * w
        self.busy_until = [0.0] * w
        self.done = [False] * len(self.batches)
        self.consumed = 0
        self.first_batch: float | None = None
        self.read_by_T = 0
        self.waiting: dict[int, tuple[int, float]] = {}  # worker -> (file, since)

    def step_readers(self, t: float, have: Callable[[int], bool]) -> None:
        s = self.s
        for w in range(s.workers):
            if self.busy_until[w] > t or self.pos[w] >= len(self.todo[w]):
                continue
            b = self.todo[w][self.pos[w]]
            if b - self.consumed >= s.workers * s.prefetch:
                continue
            f = self.batches[b][self.index[w]]
            if have(f):
                self.busy_until[w] = t + s.read_cost
                self.waiting.pop(w, None)
                self.read_by_T += t <= self.total / s.link
                self.index[w] += 1
                if self.index[w] == len(self.batches[b]):
                    self.done[b] = True
                    self.index[w] = 0
                    self.pos[w] += 1
            elif w not in self.waiting:
                self.waiting[w] = (f, t)
        while self.consumed < len(self.batches) and self.done[self.consumed]:
            self.consumed += 1
            if self.first_batch is None:
                self.first_batch = t

    @property
    def finished(self) -> bool:
        return self.consumed == len(self.batches)

    def result(self, t: float, fetched: float, requests: int) -> Result:
        return Result(t, self.total / self.s.link, self.first_batch or t, self.read_by_T,
                      fetched / self.total, requests)


def start_or_queue(k: int, slot_free: bool, start: Callable[[int], None],
                   queued: list[int]) -> None:
    """A shard first read: its whole fetch starts if a slot is free, else it queues."""
    if slot_free:
        start(k)
    else:
        queued.append(k)


def run_streams(setup: Setup, seed: int, slots: int = 8, budget: float = 0.10,
                prio: bool = False, skip: bool = False) -> Result:
    m = Model(setup, seed)
    n = len(m.shard_len)
    front: list[float | None] = [None] * n  # bytes arrived; None: not started
    began = [0.0] * n
    asked = [0.0] * n  # when the shard's current GET was asked
    # skip: a member read ahead of its shard's GET is not fetched twice: the GET ends at the
    # member and a new one asks for the rest (an arrival map in the cache, not one frontier).
    ahead: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # members ahead: start, end
    queued: list[int] = []
    members: dict[int, list[float]] = {}  # file -> [asked at, bytes left]
    dup = started = fetched = 0.0
    requests = 0
    t = 0.0

    def running() -> list[int]:
        return [k for k in range(n) if front[k] is not None and front[k] < m.shard_len[k]]

    def start(k: int) -> None:
        nonlocal started, requests
        front[k], began[k], asked[k] = 0.0, t, t
        started += m.shard_len[k]
        requests += 1

    def have(f: int) -> bool:
        k, _, end = m.where[f]
        whole = front[k] is not None and front[k] >= end
        return whole or (f in members and members[f][1] <= 0)

    while not m.finished:
        m.step_readers(t, have)
        for f, _ in m.waiting.values():
            k, _, end = m.where[f]
            if front[k] is None and k not in queued:
                start_or_queue(k, len(running()) < slots, start, queued)
            if f in members:
                continue
            eta: float | None = float("inf")
            if front[k] is not None:
                elapsed = t - began[k] - setup.latency
                rate = front[k] / elapsed if elapsed > 0 and front[k] > 64e3 else None
                eta = (end - front[k]) / rate if rate else None
            # As the reader's rule: about two member-read round trips (its bytes at a
            # quarter of the link); a shard still waiting for a slot has no eta at all.
            patience = 2 * (setup.latency + 4 * m.sizes[f] / setup.link)
            if eta is None or eta <= patience:
                continue
            start_f = m.where[f][1]
            if skip and (front[k] is None or front[k] <= start_f):
                ahead[k].append((start_f, end))
            elif dup + m.sizes[f] <= budget * started:
                dup += m.sizes[f]
            else:
                continue
            members[f] = [t, m.sizes[f]]
            requests += 1
        flows = [("shard", k) for k in running() if t - asked[k] >= setup.latency]
        flows += [("member", f) for f, (asked, left) in members.items()
                  if left > 0 and t - asked >= setup.latency]
        if prio:
            wanted = {m.where[f][0] for f, _ in m.waiting.values()}
            urgent = [fl for fl in flows if fl[0] == "member" or fl[1] in wanted]
            flows = urgent or flows
        for kind, key in flows:
            share = setup.link * setup.step / len(flows)
            fetched += share
            if kind == "shard":
                old = front[key]
                front[key] = min(m.shard_len[key], front[key] + share)  # type: ignore[operator]
                hit = [r for r in ahead[key] if old <= r[0] < front[key]]
                if hit:  # end this GET at the member, ask again past it (and any next to it)
                    new = min(hit)[1]
                    for r in sorted(ahead[key]):
                        if r[0] <= new:
                            new = max(new, r[1])
                    ahead[key] = [r for r in ahead[key] if r[0] > new]
                    fetched -= front[key] - min(hit)[0]
                    front[key] = min(m.shard_len[key], new)
                    if front[key] < m.shard_len[key]:
                        asked[key] = t
                        requests += 1
            else:
                members[key][1] -= share
        while queued and len(running()) < slots:
            start(queued.pop(0))
        t += setup.step
    return m.result(t, fetched, requests)


def run_chunks(setup: Setup, seed: int, inflight: int = 8, chunk: float = 1e6,
               prio: bool = True) -> Result:
    m = Model(setup, seed)
    n = len(m.shard_len)
    front = [0.0] * n  # contiguous bytes arrived
    asked = [0.0] * n  # bytes requested, in order
    finished_out_of_order: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    open_requests: list[list[float]] = []  # [asked at, shard, lo, hi, got]
    touched: list[int] = []  # shards in the order readers first wanted them
    fetched = 0.0
    requests = 0
    t = 0.0

    def have(f: int) -> bool:
        k, _, end = m.where[f]
        return front[k] >= end - 1e-6

    def next_shard() -> int | None:
        if prio:
            for _, k in sorted((since, m.where[f][0]) for f, since in m.waiting.values()):
                if asked[k] < m.shard_len[k]:
                    return k
        for k in touched + list(range(n)):
            if asked[k] < m.shard_len[k]:
                return k
        return None

    while not m.finished:
        m.step_readers(t, have)
        for f, _ in m.waiting.values():
            if m.where[f][0] not in touched:
                touched.append(m.where[f][0])
        while len(open_requests) < inflight and (k := next_shard()) is not None:
            hi = min(m.shard_len[k], asked[k] + chunk)
            open_requests.append([t, k, asked[k], hi, 0.0])
            asked[k] = hi
            requests += 1
        flowing = [r for r in open_requests if t - r[0] >= setup.latency]
        for r in flowing:
            r[4] += setup.link * setup.step / len(flowing)
            fetched += setup.link * setup.step / len(flowing)
        still_open = []
        for r in open_requests:
            k, lo, hi = int(r[1]), r[2], r[3]
            if front[k] >= lo - 1e-6:
                front[k] = max(front[k], min(hi, lo + r[4]))
            if r[4] >= hi - lo:
                finished_out_of_order[k].append((lo, hi))
            else:
                still_open.append(r)
        open_requests = still_open
        for k in range(n):
            done = finished_out_of_order[k]
            done.sort()
            while done and done[0][0] <= front[k] + 1e-6:
                front[k] = max(front[k], done.pop(0)[1])
        t += setup.step
    return m.result(t, fetched, requests)


def run_split(setup: Setup, seed: int, slots: int = 8, max_streams: int = 32,
              budget: float = 0.10) -> Result:
    """`streams`, but a member read ahead of its shard's GET splits that GET: the GET stops
    at the member and a new ranged GET, asked at once, fetches what followed it. Each byte is
    fetched once; the cache would hold shards filled out of order (an arrival map)."""
    m = Model(setup, seed)
    n = len(m.shard_len)
    in_shard: list[list[int]] = [[] for _ in range(n)]  # files by their offset
    for f, (k, _, _) in m.where.items():
        in_shard[k].append(f)
    for files in in_shard:
        files.sort(key=lambda f: m.where[f][1])
    arrived: set[int] = set()
    # GETs: [shard, pos, stop, asked at, index of the next file to complete, first pos]
    gets: list[list] = []
    began: dict[int, float] = {}
    queued: list[int] = []
    members: dict[int, list[float]] = {}
    dup = started = fetched = 0.0
    requests = 0
    t = 0.0

    def shards_running() -> set[int]:
        return {g[0] for g in gets}

    def start(k: int) -> None:
        nonlocal started, requests
        pos, i = 0.0, 0
        for f in in_shard[k] + [None]:  # one ranged GET per gap between members fetched
            if f is not None and f not in members:
                continue
            a, b = (m.where[f][1], m.where[f][2]) if f is not None else (m.shard_len[k], 0.0)
            if a > pos:
                gets.append([k, pos, a, t, i, pos])
                requests += 1
            pos = b
            i = in_shard[k].index(f) + 1 if f is not None else 0
        began[k] = t
        started += m.shard_len[k]
        requests += 1

    def have(f: int) -> bool:
        return f in arrived or (f in members and members[f][1] <= 0)

    while not m.finished:
        m.step_readers(t, have)
        for f, _ in m.waiting.values():
            k, a, b = m.where[f]
            if k not in began and k not in queued:
                start_or_queue(k, len(shards_running()) < slots, start, queued)
            if f in members:
                continue
            covering = [g for g in gets if g[0] == k and g[1] <= a < g[2]]
            eta: float | None = float("inf")
            if covering:
                g = covering[0]
                elapsed = t - g[3] - setup.latency
                got = g[1] - g[5]
                rate = got / elapsed if elapsed > 0 and got > 64e3 else None
                rate = setup.link / max(1, len(gets)) if rate is None and elapsed > 0 else rate
                eta = (b - g[1]) / rate if rate else None
            patience = 2 * (setup.latency + 4 * m.sizes[f] / setup.link)
            if eta is None or eta <= patience:
                continue
            if covering and covering[0][1] < a and len(gets) < max_streams:
                g = covering[0]
                if b < g[2]:
                    later = [i for i, x in enumerate(in_shard[k]) if m.where[x][1] >= b]
                    gets.append([k, b, g[2], t, later[0] if later else len(in_shard[k]), b])
                    requests += 1
                g[2] = a
            elif covering and covering[0][1] >= a and len(gets) < max_streams:
                g = covering[0]  # the GET was not yet under way there: start past the member
                g[1] = g[5] = b
                g[4] += 1
            elif dup + m.sizes[f] <= budget * started:
                dup += m.sizes[f]
            else:
                continue
            members[f] = [t, m.sizes[f]]
            requests += 1
        flows: list[tuple[str, object]] = [("get", g) for g in gets if t - g[3] >= setup.latency]
        flows += [("member", f) for f, (asked, left) in members.items()
                  if left > 0 and t - asked >= setup.latency]
        share = setup.link * setup.step / max(1, len(flows))
        for kind, key in flows:
            fetched += share
            if kind == "get":
                g = key  # type: ignore[assignment]
                g[1] = min(g[2], g[1] + share)
                files = in_shard[g[0]]
                while g[4] < len(files) and m.where[files[g[4]]][2] <= g[1]:
                    arrived.add(files[g[4]])
                    g[4] += 1
            else:
                members[key][1] -= share  # type: ignore[index]
        gets = [g for g in gets if g[1] < g[2]]
        while queued and len(shards_running()) < slots:
            start(queued.pop(0))
        t += setup.step
    return m.result(t, fetched, requests)


POLICIES = {
    "streams (today: 8 GETs, 10 % early members)": lambda s, seed: run_streams(s, seed),
    "streams, no early members": lambda s, seed: run_streams(s, seed, budget=0.0),
    "streams-prio, ideal, no early members": lambda s, seed: run_streams(
        s, seed, slots=10**6, budget=0.0, prio=True),
    "streams, members not fetched twice": lambda s, seed: run_streams(s, seed, skip=True),
    "split (a member read far ahead splits its GET), 32 GETs at most":
        lambda s, seed: run_split(s, seed),
    "chunks of 1 MB, 8 at once": lambda s, seed: run_chunks(s, seed, prio=False),
    "chunks-prio of 1 MB, 8 at once": lambda s, seed: run_chunks(s, seed),
    "chunks-prio of 1 MB, 16 at once": lambda s, seed: run_chunks(s, seed, inflight=16),
    "chunks-prio of 512 KB, 16 at once": lambda s, seed: run_chunks(s, seed, inflight=16,
                                                                    chunk=512e3),
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.epochsim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--files", type=int, default=Setup.files)
    parser.add_argument("--workers", type=int, default=Setup.workers,
                        help="DataLoader workers, each reading its batch one file at a time")
    parser.add_argument("--policies", default=None,
                        help="comma-separated beginnings of policy names (default: all)")
    args = parser.parse_args()
    setup = Setup(files=args.files, workers=args.workers)
    wanted = args.policies.split(",") if args.policies else [""]
    print("| policy | epoch / link time | first batch s | files read by T | fetched / read "
          "| requests |")
    print("|---|---|---|---|---|---|")
    for name, run in POLICIES.items():
        if not any(name.startswith(w) for w in wanted):
            continue
        rs = [run(setup, seed) for seed in range(1, args.seeds + 1)]
        print(f"| {name} | {' / '.join(f'{r.x_link:.2f}' for r in rs)}x "
              f"| {' / '.join(f'{r.first_batch:.1f}' for r in rs)} "
              f"| {' / '.join(str(r.read_by_link_time) for r in rs)} "
              f"| {' / '.join(f'{r.fetched_over_read:.2f}' for r in rs)} "
              f"| {' / '.join(str(r.requests) for r in rs)} |", flush=True)


if __name__ == "__main__":
    main()
