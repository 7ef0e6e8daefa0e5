"""What the node plugin has mounted and published, kept in its state dir across restarts.

```
STATE_DIR/state.json     volumes (key -> spec, node path, publishes), no secrets
STATE_DIR/salt           random bytes that key a volume's secrets into its key (0600)
STATE_DIR/mounts/KEY     the node mount of volume KEY (a FUSE mount, bound into pods)
```
The state dir must be on a mount shared with the host (under kubelet's dir, Bidirectional),
so that node mounts outlive the plugin's container. Written atomically (rename).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfs.csi.volume import VolumeSpec

FORMAT = "shardfs-csi-plugin/1"


@dataclass(slots=True)
class Publish:
    volume_id: str
    readonly: bool
    ephemeral: bool

    def to_json(self) -> dict[str, Any]:
        return {"volume_id": self.volume_id, "readonly": self.readonly,
                "ephemeral": self.ephemeral}


@dataclass(slots=True)
class Volume:
    key: str
    spec: VolumeSpec
    node_path: str
    publishes: dict[str, Publish] = field(default_factory=dict)  # target path -> publish

    def to_json(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "node_path": self.node_path,
                "publishes": {t: p.to_json() for t, p in self.publishes.items()}}


class PluginState:
    """The volumes, guarded by one lock; every change is saved before it is acted on
    (a volume is recorded before its mount, and forgotten after its release)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.lock = threading.RLock()
        self.volumes: dict[str, Volume] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        # Traversable, not listable: the mounter's daemons (maybe another uid) reach their
        # node mounts; state.json and salt are 0600.
        os.chmod(self.dir, 0o711)
        (self.dir / "mounts").mkdir(exist_ok=True)
        os.chmod(self.dir / "mounts", 0o711)
        self.salt = self._salt()
        self._load()

    def _salt(self) -> bytes:
        path = self.dir / "salt"
        try:
            return path.read_bytes()
        except FileNotFoundError:
            pass
        salt = os.urandom(32)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(salt)
        os.replace(tmp, path)
        return salt

    def _load(self) -> None:
        path = self.dir / "state.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown format {data.get('format')!r}")
        for key, v in data["volumes"].items():
            self.volumes[key] = Volume(
                key, VolumeSpec.from_json(v["spec"]), v["node_path"],
                {t: Publish(**p) for t, p in v["publishes"].items()})

    def save(self) -> None:
        with self.lock:
            data = {"format": FORMAT,
                    "volumes": {k: v.to_json() for k, v in self.volumes.items()}}
            path = self.dir / "state.json"
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

    def node_path(self, key: str) -> str:
        return str(self.dir / "mounts" / key)

    def find_target(self, target: str) -> tuple[Volume, Publish] | None:
        with self.lock:
            for volume in self.volumes.values():
                if target in volume.publishes:
                    return volume, volume.publishes[target]
        return None
