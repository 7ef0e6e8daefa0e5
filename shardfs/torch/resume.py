"""Mid-epoch resume for shardfs's samplers: the `state_dict()` / `load_state_dict()` pair that
torchdata's `StatefulDataLoader` calls (it saves the sampler's state with each batch it hands
out, so the state says how many indices the loader has taken from the current iteration, not
how far any prefetching got).

A sampler's state is where its current iteration stands: the epoch and the number of indices
yielded so far (plus what a wrapped sampler needs to draw the same order again). After
`load_state_dict`, the next iteration of that epoch yields exactly the indices the saved one
had not yielded yet, in the same order; a `set_epoch` to another epoch in between drops the
resume (a new epoch starts from its beginning).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

STATE_FORMAT = "shardfs-sampler-state/1"


@dataclass(slots=True)
class Progress:
    """The current iteration of a sampler: its epoch and the indices yielded so far."""

    epoch: int | None = None
    yielded: int = 0

    def count(self, indices: Iterable[int]) -> Iterator[int]:
        """`indices`, counted as they are yielded."""
        for index in indices:
            self.yielded += 1
            yield index


@dataclass(slots=True)
class Resume:
    """A position loaded by load_state_dict, used by the next iteration of its epoch."""

    epoch: int | None
    skip: int


def make_state(kind: str, progress: Progress, length: int, **extra: Any) -> dict[str, Any]:
    return {"format": STATE_FORMAT, "sampler": kind, "epoch": progress.epoch,
            "yielded": progress.yielded, "length": length, **extra}


def read_state(state: Any, kind: str, length: int, **expected: Any) -> Resume:
    """Check a saved state against this sampler (ValueError naming what differs)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a shardfs sampler state (format {STATE_FORMAT!r} expected)")
    if state.get("sampler") != kind:
        raise ValueError(f"this state is of a {state.get('sampler')}, not a {kind}")
    if state.get("length") != length:
        raise ValueError(f"this state is of a sampler of {state.get('length')} indices; this "
                         f"one has {length} (the dataset changed?)")
    for key, value in expected.items():
        if state.get(key) != value:
            raise ValueError(f"this state was saved with {key}={state.get(key)!r}; this sampler "
                             f"has {key}={value!r}")
    yielded = state.get("yielded")
    if not isinstance(yielded, int) or not 0 <= yielded <= length:
        raise ValueError(f"bad position in the sampler state: yielded={yielded!r}")
    epoch = state.get("epoch")
    if epoch is not None and not isinstance(epoch, int):
        raise ValueError(f"bad epoch in the sampler state: {epoch!r}")
    return Resume(epoch, yielded)
