"""Human-friendly byte sizes for command-line options ("256MiB", "1G", "123456").

Convention (documented in --help): a bare letter (K, M, G, T, P) and the IEC forms (KiB, MiB, ...)
are binary (powers of 1024), because shard and cache sizes are usually thought of that way; the
SI forms with a B (KB, MB, GB, ...) are decimal (powers of 1000). Units are case-insensitive.
"""

from __future__ import annotations

import re
import time

_PREFIXES = "kmgtpe"
_UNITS: dict[str, int] = {"": 1, "b": 1, "byte": 1, "bytes": 1}
for _i, _p in enumerate(_PREFIXES, start=1):
    _UNITS[_p] = 1024**_i
    _UNITS[f"{_p}ib"] = 1024**_i
    _UNITS[f"{_p}b"] = 1000**_i

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)

UNITS_HELP = "B; K, M, G, T or KiB, MiB, GiB, TiB for powers of 1024; KB, MB, GB, TB for 1000"


def parse_size(text: str) -> int:
    """Parse a byte size such as "123456", "64K", "256MiB", "1.5G" or "100MB"; returns bytes.

    Raises ValueError with a message that quotes the input and lists the accepted units.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        if text.strip().startswith("-"):
            raise ValueError(f"invalid size {text!r}: sizes cannot be negative")
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit "
                         f"[{UNITS_HELP}]")
    number, unit = match.group(1), match.group(2).lower()
    multiplier = _UNITS.get(unit)
    if multiplier is None:
        raise ValueError(f"invalid size {text!r}: unknown unit {match.group(2)!r} "
                         f"[{UNITS_HELP}]")
    if multiplier == 1:
        # A fraction of a byte is almost certainly a typo (a forgotten unit), not a request.
        if "." in number and float(number) != int(float(number)):
            raise ValueError(f"invalid size {text!r}: a size in bytes must be a whole number")
        return int(float(number)) if "." in number else int(number)
    if "." in number:
        return round(float(number) * multiplier)
    return int(number) * multiplier


def format_size(n: int) -> str:
    """Render a byte count compactly with binary units, e.g. 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """A span of time for people: `45 s`, `12 min`, `5.5 h`, `3 days`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def format_utc(when: float) -> str:
    """A Unix time for people, in UTC: `2026-12-01 00:00 UTC`."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))
