"""Pure parsing of tar headers (ustar, GNU long names/links, pax). No I/O.

INTERFACE SKELETON — to be implemented. See the docstrings for the contract.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

BLOCK = 512

MemberKind = Literal["f", "d", "l"]  # regular file (hard links resolved to 'f'), directory, symlink


class TarError(ValueError):
    """The archive is not a tar, is corrupt, or is truncated. `offset` is where it went wrong."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(f"{message} (at byte {offset})")
        self.offset = offset


@dataclass(frozen=True, slots=True)
class Member:
    path: bytes  # normalized, relative, '/'-separated, no '.', '..' or empty components
    kind: MemberKind
    offset: int  # byte offset of the member's data within the archive
    size: int  # data size in bytes (0 for directories and symlinks)
    mtime: int  # seconds since the epoch
    mode: int  # permission bits only (0o7777 mask)
    linkname: bytes = b""  # symlink target, as stored (relative, stays inside the tree)


def normalize_path(raw: bytes) -> bytes | None:
    """Normalize a member name; None if it is unsafe (absolute, escapes with '..', empty)."""
    raise NotImplementedError


class TarScanner:
    """Incremental tar header parser: feed the archive's bytes in order, get members back."""

    def __init__(self) -> None:
        self.skipped: Counter[str] = Counter()  # reason -> count of members not exposed
        raise NotImplementedError

    def feed(self, data: bytes | memoryview) -> list[Member]:
        raise NotImplementedError

    @property
    def skippable(self) -> int:
        """Bytes of member data that follow and that the caller may skip() instead of feed()."""
        raise NotImplementedError

    def skip(self, n: int) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """True once the end-of-archive marker was seen (further bytes are ignored)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Declare end of input. Raises TarError if the archive is truncated."""
        raise NotImplementedError
