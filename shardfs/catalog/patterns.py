"""WebDataset-style brace patterns: `train-{000000..000031}.tar`, `{a,b}`, several groups."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_MAX_EXPANSION = 10_000_000  # a typo like {0..99999999999} must fail fast, not eat memory


class PatternError(ValueError):
    """A brace pattern that cannot be expanded (unbalanced, empty, reversed or huge)."""


def _alternatives(body: str, pattern: str) -> list[str]:
    match = _RANGE.match(body)
    if match:
        first, last = match.group(1), match.group(2)
        lo, hi = int(first), int(last)
        if hi < lo:
            raise PatternError(f"range {{{body}}} in {pattern!r} runs backwards")
        if hi - lo + 1 > _MAX_EXPANSION:
            raise PatternError(f"range {{{body}}} in {pattern!r} is too large")
        # As in braceexpand (which WebDataset uses): if either bound is zero-padded, every
        # number is padded to the width of the wider bound.
        padded = any(b.startswith(("0", "-0")) for b in (first, last) if b not in ("0", "-0"))
        width = max(len(first), len(last)) if padded else 0
        return [f"{n:0{width}d}" for n in range(lo, hi + 1)]
    if "," in body:
        return body.split(",")
    raise PatternError(f"cannot expand {{{body}}} in {pattern!r}: use {{A..B}} or {{a,b,...}}")


def expand_braces(pattern: str) -> list[str]:
    """All strings the pattern names, in order. A pattern without braces is returned as is."""
    open_at = pattern.find("{")
    if open_at < 0:
        if "}" in pattern:
            raise PatternError(f"unbalanced '}}' in {pattern!r}")
        return [pattern]
    close_at = pattern.find("}", open_at)
    if close_at < 0:
        raise PatternError(f"unbalanced '{{' in {pattern!r}")
    body = pattern[open_at + 1 : close_at]
    if "{" in body:
        raise PatternError(f"nested braces are not supported in {pattern!r}")
    head, tail = pattern[:open_at], pattern[close_at + 1 :]
    if "}" in head:
        raise PatternError(f"unbalanced '}}' in {pattern!r}")
    tails = expand_braces(tail)
    alts = _alternatives(body, pattern)
    # Check the product before building it: several groups multiply.
    if len(alts) * len(tails) > _MAX_EXPANSION:
        raise PatternError(f"{pattern!r} expands to more than {_MAX_EXPANSION} names")
    return [head + alt + rest for alt in alts for rest in tails]
