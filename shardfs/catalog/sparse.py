"""Sparse members (GNU tar 'S' and pax GNU.sparse.*): a file made of data runs and holes.

A sparse map is a flat sequence of numbers `[off0, len0, off1, len1, ...]`: logical offsets
of the data runs, ascending and non-overlapping, each with its length. The runs' bytes are
stored back to back in the shard from the member's data offset; everything else reads as
zeros. Only sparse members carry a map, so plain members cost nothing extra.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence

SparseMap = Sequence[int]
HOLE = -1  # stored offset of a piece that reads as zeros


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


def stored_size(runs: SparseMap) -> int:
    """Bytes the data runs take in the shard."""
    return sum(runs[1::2])


def pieces(runs: SparseMap, size: int, off: int, length: int) -> list[tuple[int, int]]:
    """Logical bytes [off, off+length) of a file of `size` bytes, clipped to its end, as
    (stored offset, length) pieces in order; the stored offset is HOLE for zeros."""
    end = min(size, off + length)
    out: list[tuple[int, int]] = []
    if off >= end:
        return out
    starts = runs[0::2]
    lengths = runs[1::2]
    # First run that could overlap `off`: the last one starting at or before it.
    i = max(0, bisect_right(starts, off) - 1)
    stored = sum(lengths[:i])
    pos = off
    while pos < end:
        if i >= len(starts):
            out.append((HOLE, end - pos))
            break
        start, run = starts[i], lengths[i]
        if pos < start:  # a hole before this run
            step = min(start, end) - pos
            out.append((HOLE, step))
            pos += step
            continue
        if pos < start + run:
            step = min(start + run, end) - pos
            out.append((stored + pos - start, step))
            pos += step
        stored += run
        i += 1
    return out


def encode_map(runs: SparseMap) -> bytes:
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
