"""`Lookahead(sampler)`: any sampler's exact order, announced to the shardfs daemon ahead of use.

With a dataset larger than the mount's cache, a uniformly random order (RandomSampler,
DistributedSampler) makes every sample its own member request, and only as many are in
flight as DataLoader workers ask for at once: the epoch is latency bound. The order is known
in advance, though (NoPFS, "Clairvoyant Prefetching for Distributed Machine Learning I/O",
SC'21): this wrapper pulls indices from the wrapped sampler a window ahead of what it yields
and tells the mount's daemon which files they name, so the daemon fetches them with many
requests in flight and holds them in RAM until read (shardfs/read/lookahead.py).

The order is the wrapped sampler's, untouched: same indices, same length, `set_epoch`
forwarded. Announcements only steer prefetching; a wrong one costs bytes, never correctness.
The announcing connection is opened lazily by the process that iterates (the DataLoader's main
process), reopened after a fork, and never pickled. When it fails (the daemon died, or is being
replaced: a holder's spare takes the mount over within seconds, on the same socket), the order
goes on unannounced to that mount and the socket is tried again `RETRY_S` later, and at every
new epoch; a new connection first announces, as a new epoch would, every index pulled ahead
and not yet yielded, so the new daemon knows the rest of the window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from shardfs.torch.announce import AnnounceLink, MountLocator
from shardfs.torch.resume import Progress, Resume, make_state, read_state
from shardfs.torch.shardmap import sample_paths

log = logging.getLogger(__name__)
DEFAULT_WINDOW = 2048  # samples announced ahead of the one yielded
_HEAD = 64  # entries in an iteration's first announcement
_PROBES = 16
RETRY_S = 2.0  # a failed announce socket is tried again after this long


class Lookahead(Sampler[int]):
    """Yields exactly the wrapped sampler's indices and announces the files they name to the
    shardfs daemon `window` samples ahead, so a random order reads at link speed.

    `sampler=Lookahead(RandomSampler(ds))` in place of `shuffle=True`; works with any sampler
    of single indices (RandomSampler, DistributedSampler, SubsetRandomSampler, your own). The
    dataset is taken from the sampler (`.data_source`, `.dataset`) or given as `dataset`; its
    files come from `.samples`/`.imgs` (ImageFolder-like, also through Subset), or `paths`
    gives one path per dataset index. Files not on a shardfs mount pass through unannounced
    (with a warning when none is).
    """

    def __init__(self, sampler: Sampler[int] | Any, dataset: Any = None, *,
                 window: int = DEFAULT_WINDOW, paths: Sequence[str] | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self.sampler = sampler
        self.window = window
        if paths is None:
            if dataset is None:
                dataset = getattr(sampler, "data_source", None)
            if dataset is None:
                dataset = getattr(sampler, "dataset", None)
            if dataset is None:
                raise TypeError(f"cannot find the dataset of {type(sampler).__name__}: pass it "
                                "as Lookahead(sampler, dataset) or give paths=")
            paths = sample_paths(dataset)
        self.paths = [os.fspath(p) for p in paths]
        self._locator = MountLocator()
        self._links: dict[str, AnnounceLink] = {}
        self._dead: dict[str, float] = {}  # sockets that failed -> when (tried again later)
        self._warned: set[str] = set()  # sockets whose failure was warned of
        self._progress: Progress | None = None  # the current iteration (state_dict)
        self._rng: dict[str, Any] = {}  # what the wrapped sampler drew its order from
        self._resume: tuple[Resume, dict[str, Any]] | None = None  # from load_state_dict
        self.active = self._probe()
        if not self.active and self.paths:
            warnings.warn("the dataset's files are not on a shardfs mount with lookahead: "
                          "Lookahead passes the sampler's order through unannounced",
                          stacklevel=2)

    # -- the sampler -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        loaded, self._resume = self._resume, None
        epoch = self._epoch()
        resume, rng = loaded if loaded is not None else (None, {})
        if resume is None or resume.epoch != epoch:
            resume, rng = None, {}  # a new epoch: its order is drawn anew
        skip = resume.skip if resume is not None else 0
        # Set now, not at the first index: a state_dict() before that says where this
        # iteration starts (a StatefulDataLoader takes one when it starts an iteration; with
        # no generator state, a load draws the order anew: nothing was yielded from it).
        self._progress = progress = Progress(epoch, skip)
        self._rng = rng
        return self._iterate(progress, skip, rng)

    def _iterate(self, progress: Progress, skip: int, rng: dict[str, Any]) -> Iterator[int]:
        it = self._start(skip, rng)
        if not self.active:
            yield from progress.count(it)
            return
        ahead: deque[int] = deque()
        unsent: list[int] = []
        first, exhausted, told_last = True, False, False
        batch = max(1, self.window // 4)
        while True:
            while not exhausted and len(ahead) < self.window:
                try:
                    index = next(it)
                except StopIteration:
                    exhausted = True
                    break
                ahead.append(index)
                unsent.append(index)
            if (unsent and (first or exhausted or len(unsent) >= batch)) or \
                    (exhausted and not told_last):
                if first:  # a short head first: the daemon starts fetching before it has
                    self._dead.clear()  # (a new epoch tries failed sockets again)
                    self._announce(unsent[:_HEAD], reset=True)  # resolved the whole window
                    unsent = unsent[_HEAD:]
                    first = False
                if unsent or exhausted:
                    # The epoch's end is said with its last files: a mount holding the
                    # whole dataset then fetches the shards' remaining bytes.
                    self._announce(unsent, reset=False, last=exhausted)
                    told_last = exhausted
                unsent = []
                if self._dead:
                    self._retry(list(ahead), last=exhausted)
            if not ahead:
                self._settle()  # the daemon has read every announcement of this iteration
                return
            progress.yielded += 1
            yield ahead.popleft()

    # -- resuming mid-epoch (torchdata's StatefulDataLoader) ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the current iteration stands: the wrapped sampler's epoch, the indices yielded
        (not the ones pulled ahead), and the generator state its order was drawn from."""
        progress = self._progress or Progress(self._epoch(), 0)
        return make_state("Lookahead", progress, len(self), **self._rng)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration yields what the saved one had not yet, in the same order: the
        wrapped sampler's order is drawn again (its epoch set, its generator put back) and
        the indices already yielded are skipped, not announced. Exact for samplers whose order
        follows from their generator and epoch (RandomSampler, SubsetRandomSampler,
        DistributedSampler, ...). ValueError for a state of another sampler or length."""
        resume = read_state(state, "Lookahead", len(self))
        rng = {k: state.get(k) for k in ("generator", "global_rng")}
        for key, value in rng.items():
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"bad {key} in the Lookahead state: {type(value).__name__}")
        if resume.epoch is not None:
            self.set_epoch(resume.epoch)
        self._resume = (resume, rng)

    def _epoch(self) -> int | None:
        epoch = getattr(self.sampler, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _start(self, skip: int, rng: dict[str, Any]) -> Iterator[int]:
        """The wrapped sampler's iterator, past the `skip` indices a loaded position had
        yielded (drawn from the generator state `rng` it saved). Runs at the iteration's first
        index, where the wrapped sampler would draw its order anyway."""
        gen = getattr(self.sampler, "generator", None)
        saved_global = None
        if isinstance(gen, torch.Generator) and rng.get("generator") is not None:
            gen.set_state(rng["generator"])
        elif gen is None and rng.get("global_rng") is not None:
            saved_global = torch.get_rng_state()  # the order's seed came from the global RNG
            torch.set_rng_state(rng["global_rng"])
        # What the order is drawn from, kept for state_dict (RandomSampler draws at its first
        # index: with generator=None, a seed from torch's global RNG).
        if isinstance(gen, torch.Generator):
            self._rng = {"generator": gen.get_state(), "global_rng": None}
        elif gen is None and hasattr(self.sampler, "generator"):
            self._rng = {"generator": None, "global_rng": torch.get_rng_state()}
        else:
            self._rng = {"generator": None, "global_rng": None}
        it = iter(self.sampler)
        try:
            for _ in range(skip):
                next(it)
        except StopIteration:
            it = iter(())
        finally:
            if saved_global is not None:
                torch.set_rng_state(saved_global)  # the caller's RNG goes on as before
        return it

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_links"] = {}  # a connection belongs to the process that opened it
        state["_dead"] = {}
        return state

    def close(self) -> None:
        """Close the announcing connections (the daemon drops what they announced)."""
        for link in self._links.values():
            if link.pid == os.getpid():
                link.close()
        self._links.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- announcing ------------------------------------------------------------------------
    def _probe(self) -> bool:
        n = len(self.paths)
        picks = sorted({i * n // _PROBES for i in range(min(n, _PROBES))})
        return any(self._locate(self.paths[i]) is not None for i in picks)

    def _locate(self, path: str) -> tuple[str, str] | None:
        return self._locator.locate(path)

    def _retry(self, window: list[int], *, last: bool) -> None:
        """Connect again to the sockets that failed RETRY_S ago or more (a daemon that took
        the mount over listens on the same one), announcing the window pulled ahead as a new
        epoch's: the new daemon knows nothing of what the old one was told."""
        now = time.monotonic()
        due = {a for a, failed in self._dead.items() if now - failed >= RETRY_S}
        if not due:
            return
        for address in due:
            del self._dead[address]
        self._announce(window, reset=True, last=last, only=due)
        for address in due - self._dead.keys():
            log.info("announcing to the shardfs daemon at %s again", address)

    def _announce(self, indices: list[int], *, reset: bool, last: bool = False,
                  only: set[str] | None = None) -> None:
        """Tell the mounts holding the files of `indices` (only the sockets in `only`, when
        given) that they come next."""
        per_socket: dict[str, list[str]] = {}
        paths = self.paths
        for index in indices:
            try:
                where = self._locate(paths[index])
            except (IndexError, TypeError):
                continue  # not an index of this dataset: nothing to announce for it
            if where is not None and (only is None or where[0] in only):
                per_socket.setdefault(where[0], []).append(where[1])
        if reset or last:  # a new epoch: every mount forgets what the last one left unread;
            for address in self._links:  # its end: every mount hears of it
                if only is None or address in only:
                    per_socket.setdefault(address, [])
        for address, rels in per_socket.items():
            if address in self._dead:
                continue
            try:
                link = self._links.get(address)
                if link is None or link.pid != os.getpid():
                    link = self._links[address] = AnnounceLink(address)
                message: dict[str, Any] = {"paths": rels}
                if reset:
                    message["reset"] = True
                if last:
                    message["last"] = True
                self._check(address, link.collect())
                link.post(message)
            except (OSError, ValueError) as exc:
                self._give_up(address, exc)

    def _settle(self) -> None:
        """Read the replies still owed (raising nothing: a failed link is given up)."""
        for address, link in list(self._links.items()):
            if link.pid == os.getpid():
                try:
                    self._check(address, link.collect())
                except (OSError, ValueError) as exc:
                    self._give_up(address, exc)

    @staticmethod
    def _check(address: str, replies: list[dict[str, Any]]) -> None:
        for reply in replies:
            if reply.get("refused"):
                log.debug("the daemon at %s refused %d announcements (its cap)", address,
                          reply["refused"])

    def _give_up(self, address: str, exc: Exception) -> None:
        self._dead[address] = time.monotonic()
        link = self._links.pop(address, None)
        if link is not None:
            link.close()
        if address in self._warned:
            log.info("cannot announce to the shardfs daemon at %s (%s)", address, exc)
            return
        self._warned.add(address)
        warnings.warn(f"cannot announce to the shardfs daemon at {address} ({exc}); reading "
                      f"on without lookahead, trying again in {RETRY_S:g} s and at the next "
                      "epoch", stacklevel=4)
