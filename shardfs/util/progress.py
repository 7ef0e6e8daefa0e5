"""Progress for long work: a redrawn line on a terminal, a plain line every ~10 % otherwise
(so logs and journald get a few lines, not thousands)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_open_lines: set[ProgressLine] = set()  # drawn on a terminal, not yet ended with a newline


def end_lines() -> None:
    """End any progress line still open on a terminal, so that the next message (a log line,
    an error) starts on a line of its own."""
    for line in list(_open_lines):
        line.close()


class ProgressLine:
    def __init__(self, label: str, stream: TextIO | None = None, unit: str = "") -> None:
        self.label = label
        self.unit = f" {unit}" if unit else ""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._next_pct = 0
        self._last_draw = 0.0
        self._drawn = False
        self._width = 0

    def update(self, phase: str, done: int, total: int, detail: str = "") -> None:
        """`detail` (e.g. bytes streamed so far) is shown after the count; it moves between
        counts, so a terminal sees progress before the first item is done."""
        pct = 100 * done // total if total > 0 else 100
        extra = f", {detail}" if detail else ""
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or (done >= total and not detail):
                self._last_draw = now
                # Pad over the tail of a longer earlier line (the detail changes width).
                text = f"{self.label}: {done}/{total}{self.unit} ({pct}%{extra})"
                self.stream.write(f"\r{text}{' ' * max(0, self._width - len(text))}")
                self.stream.flush()
                self._width = len(text)
                self._drawn = True
                _open_lines.add(self)
        elif pct >= self._next_pct and not detail:
            self._next_pct = (pct // 10 + 1) * 10
            print(f"{self.label}: {done}/{total}{self.unit} ({pct}%)", file=self.stream,
                  flush=True)

    def __call__(self, done: int, total: int) -> None:
        self.update("", done, total)

    def close(self) -> None:
        _open_lines.discard(self)
        if self._drawn:
            self._drawn = False
            self._width = 0
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):  # the terminal went away
                pass
