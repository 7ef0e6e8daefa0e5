"""Progress for long work: a redrawn line on a terminal, a plain line every ~10 % otherwise
(so logs and journald get a few lines, not thousands)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    def __init__(self, label: str, stream: TextIO | None = None, unit: str = "") -> None:
        self.label = label
        self.unit = f" {unit}" if unit else ""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._next_pct = 0
        self._last_draw = 0.0
        self._drawn = False

    def update(self, phase: str, done: int, total: int) -> None:
        pct = 100 * done // total if total > 0 else 100
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or done >= total:
                self._last_draw = now
                self.stream.write(f"\r{self.label}: {done}/{total}{self.unit} ({pct}%)")
                self.stream.flush()
                self._drawn = True
        elif pct >= self._next_pct:
            self._next_pct = (pct // 10 + 1) * 10
            print(f"{self.label}: {done}/{total}{self.unit} ({pct}%)", file=self.stream,
                  flush=True)

    def __call__(self, done: int, total: int) -> None:
        self.update("", done, total)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
