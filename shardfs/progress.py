"""Progress for long work: a live line on a terminal, a log line every ~10 % otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)


class ProgressLine:
    def __init__(self, label: str, stream=None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_logged = -1
        self._last_draw = 0.0
        self._drawn = False

    def update(self, phase: str, done: int, total: int) -> None:
        if total <= 0:
            return
        pct = 100 * done // total
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or done == total:
                self._last_draw = now
                self.stream.write(f"\r{self.label}: {done}/{total} ({pct}%)")
                self.stream.flush()
                self._drawn = True
        elif pct // 10 != self._last_logged // 10 or done == total:
            self._last_logged = pct
            log.info("%s: %d/%d (%d%%)", self.label, done, total, pct)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
