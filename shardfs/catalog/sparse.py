"""Sparse members (GNU tar 'S' and pax GNU.sparse.*): a file made of data runs and holes.

A sparse map is a flat sequence of numbers `[off0, len0, off1, len1, ...]`: logical offsets
of the data runs, ascending and non-overlapping, each with its length. The runs' bytes are
stored back to back in the shard from the member's data offset; everything else reads as
zeros. Only sparse members carry a map, so plain members cost nothing extra.

Index files and the scanner keep the flat sequence; the tree keeps a `SparseMap`, which adds
the lookup tables (run starts, stored bytes before each run) so that a read costs O(log runs)
however many runs a file has.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

Runs = Sequence[int]  # the flat [off0, len0, off1, len1, ...]
HOLE = -1  # stored offset of a piece that reads as zeros


@dataclass(frozen=True, slots=True)
class SparseMap:
    runs: array  # Q: the flat runs
    starts: array  # Q: logical offset of each run
    before: array  # Q: stored bytes before each run, and in all of them last

    @classmethod
    def of(cls, runs: Runs) -> SparseMap:
        flat = array("Q", runs)
        return cls(flat, flat[0::2], array("Q", accumulate(flat[1::2], initial=0)))

    @property
    def stored(self) -> int:
        """Bytes the data runs take in the shard."""
        return self.before[-1]


def make_map(runs: Sequence[tuple[int, int]], size: int) -> array | None:
    """The map of `runs` ((offset, length) pairs, in archive order) for a file of `size`
    bytes; None when the runs are out of order, overlap or reach past the end (GNU tar
    reports such a member as malformed). Empty runs (GNU writes one to end on a hole) go."""
    out = array("Q")
    end = 0
    for offset, length in runs:
        if offset < end or length < 0 or offset + length > size:
            return None
        if length:
            out.append(offset)
            out.append(length)
            end = offset + length
    return out


def stored_size(runs: Runs) -> int:
    """Bytes the data runs take in the shard."""
    return sum(runs[1::2])


def pieces(smap: SparseMap, size: int, off: int, length: int) -> list[tuple[int, int]]:
    """Logical bytes [off, off+length) of a file of `size` bytes, clipped to its end, as
    (stored offset, length) pieces in order; the stored offset is HOLE for zeros."""
    end = min(size, off + length)
    out: list[tuple[int, int]] = []
    if off >= end:
        return out
    starts, runs, before = smap.starts, smap.runs, smap.before
    # First run that could overlap `off`: the last one starting at or before it.
    i = max(0, bisect_right(starts, off) - 1)
    pos = off
    while pos < end:
        if i >= len(starts):
            out.append((HOLE, end - pos))
            break
        start, run = starts[i], runs[2 * i + 1]
        if pos < start:  # a hole before this run
            step = min(start, end) - pos
            out.append((HOLE, step))
            pos += step
            continue
        if pos < start + run:
            step = min(start + run, end) - pos
            out.append((before[i] + pos - start, step))
            pos += step
        i += 1
    return out


def encode_map(runs: Runs) -> bytes:
    return b",".join(b"%d" % n for n in runs)


def decode_map(text: bytes, size: int) -> array:
    """Parse `encode_map` output; ValueError unless it is a valid map for `size` bytes."""
    numbers = [int(n) for n in text.split(b",")] if text else []
    if len(numbers) % 2:
        raise ValueError("odd number of fields in a sparse map")
    pairs = list(zip(numbers[0::2], numbers[1::2], strict=True))
    runs = make_map(pairs, size)
    if runs is None or len(runs) != len(numbers):
        raise ValueError("sparse map is out of order, overlaps or passes the end")
    return runs
