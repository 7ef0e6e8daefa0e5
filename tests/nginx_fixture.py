"""The `nginx` fixture: a real nginx on loopback serving a fresh directory (`nginx.root`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.devtools.nginx import Nginx


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    root = tmp_path / "www"
    root.mkdir()
    server = Nginx(root, tmp_path / "nginx")
    server.start()
    try:
        yield server
    finally:
        server.stop()
