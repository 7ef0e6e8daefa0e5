"""Logging for the command line and the daemon: shardfs's own lines, libraries kept quiet."""

from __future__ import annotations

import logging
import os
import sys

from shardfs.util.progress import end_lines
from shardfs.util.urls import redact

# Libraries that log every request at INFO (httpx: "HTTP Request: GET ..."): one line per
# member read is noise at the default level. At --log-level debug httpx's request lines show.
_CHATTY = {"httpx": logging.INFO, "httpcore": logging.WARNING, "hpack": logging.WARNING,
           "botocore": logging.WARNING, "urllib3": logging.WARNING, "asyncio": logging.WARNING,
           "google": logging.WARNING}


class _RedactingFormatter(logging.Formatter):
    """Log lines never carry a signed URL's signature (util/urls.py, `redact`): sources named
    by signed URLs (an Azure SAS, a presigned URL) appear in many lines."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def _formatter(to_file: bool) -> logging.Formatter:
    # journald adds its own timestamps; a terminal or file wants them.
    under_journal = "JOURNAL_STREAM" in os.environ and not to_file
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journal else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    return _RedactingFormatter(fmt)


def _apply_level(level: str) -> None:
    value = logging.getLevelName(level.upper())
    logging.getLogger().setLevel(value)
    for name, floor in _CHATTY.items():
        # Quiet unless the user asked for debug; never louder than the root level.
        quiet = floor if value <= logging.DEBUG else logging.WARNING
        logging.getLogger(name).setLevel(max(quiet, value))


def setup_logging(level: str, log_file: str | None = None) -> None:
    """One handler: a file if given, else stderr."""
    handler: logging.Handler
    handler = logging.FileHandler(log_file) if log_file else _TerminalHandler(sys.stderr)
    handler.setFormatter(_formatter(bool(log_file)))
    logging.getLogger().handlers[:] = [handler]
    _apply_level(level)


class _TerminalHandler(logging.StreamHandler):
    """stderr, starting on a fresh line when a progress line is drawn there."""

    def emit(self, record: logging.LogRecord) -> None:
        end_lines()
        super().emit(record)


class MountLog:
    """The daemon's logging: the terminal while the user waits for the mount, plus (once
    daemonizing) the log file from the first line on, so mount-time lines are kept too."""

    def __init__(self, level: str) -> None:
        self._terminal = _TerminalHandler(sys.stderr)
        self._terminal.setFormatter(_formatter(False))
        self._file: logging.FileHandler | None = None
        logging.getLogger().handlers[:] = [self._terminal]
        _apply_level(level)

    def set_level(self, level: str) -> None:
        _apply_level(level)

    def add_file(self, path: str) -> None:
        self._file = logging.FileHandler(path)
        self._file.setFormatter(_formatter(True))
        logging.getLogger().addHandler(self._file)

    def detach_terminal(self) -> None:
        root = logging.getLogger()
        if self._file is not None and self._terminal in root.handlers:
            root.removeHandler(self._terminal)

    def close_file(self) -> None:
        if self._file is not None:
            logging.getLogger().removeHandler(self._file)
            self._file.close()
            self._file = None
