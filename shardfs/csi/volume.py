"""A volume as a pod declares it: `volumeAttributes` + secrets -> what one daemon serves.

`source` is what `shardfs mount` takes as SOURCE (several separated by spaces); every other
attribute is a key of the YAML config, validated by the config's own rules and messages.
Kubelet's own attributes (`csi.storage.k8s.io/...`: pod name, namespace, uid, service account,
ephemeral) are not part of the volume: two pods naming the same shards with the same settings
and credentials share one daemon and one cache (the volume's `key`).

Pod-level credentials (`authentication_source: pod`): csi/podidentity.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardfs.cli.config import ConfigError, validate
from shardfs.csi.podidentity import ATTRIBUTES as POD_ATTRIBUTES
from shardfs.csi.podidentity import (
    KUBELET_PREFIX,
    PodIdentity,
    PodIdentityError,
    parse_pod_identity,
)

EPHEMERAL = KUBELET_PREFIX + "ephemeral"

# Attributes that would let a pod reach into the node (paths, ports, secrets on disk) or
# that the driver sets itself.
_NOT_SETTABLE = {
    "sources": "use 'source' (shards separated by spaces)",
    "mountpoint": "the driver chooses where it mounts",
    "cache_dir": "caches live under the mounter's --cache-root",
    "log_file": "the log is shardfs.log in the volume's cache dir",
    "credentials": "pass secrets with nodePublishSecretRef",
    "nonempty": "the driver mounts on directories of its own",
    "allow_other": "always on: every user of the pod may read the volume",
}

# Sources a pod may name. Local paths and file:// would be resolved in the mounter's
# container, whose files (other volumes' caches, its state) are not the pod's to read.
REMOTE_SCHEMES = ("http", "https", "s3", "gs", "hf", "ais")

# Secret keys (nodePublishSecretRef) -> the daemon's environment variable of the same name;
# GOOGLE_CREDENTIALS_JSON (the content of a Google credentials file: a service-account key, a
# workload identity federation config) is written to a private file of the mounter's, which
# GOOGLE_APPLICATION_CREDENTIALS names to the daemon (csi/mounter/volumes.py).
GOOGLE_CREDENTIALS_JSON = "GOOGLE_CREDENTIALS_JSON"
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
               "GS_ACCESS_KEY_ID", "GS_SECRET_ACCESS_KEY", GOOGLE_CREDENTIALS_JSON,
               "SHARDFS_URL_QUERY")


class VolumeError(ValueError):
    """Bad volume attributes or secrets; the message never contains a secret's value."""


@dataclass(frozen=True, slots=True)
class VolumeSpec:
    """What the daemon of one volume is started with (secrets travel apart, never stored
    with it by the plugin)."""

    sources: list[str]
    options: dict[str, Any] = field(default_factory=dict)  # validated config keys
    gid: int | None = None  # the pod's fsGroup (VOLUME_MOUNT_GROUP)
    pod: PodIdentity | None = None  # authentication_source: pod (csi/podidentity.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VolumeSpec:
        return cls(sources=list(data["sources"]), options=dict(data.get("options") or {}),
                   gid=data.get("gid"), pod=PodIdentity.from_json(data.get("pod")))

    def key(self, secrets: Mapping[str, str], salt: bytes) -> str:
        """The volume's identity on the node: the same shards, settings, group and secrets
        give the same key. Secrets enter as a keyed hash (salt: the node's own random key),
        so the key says nothing about them."""
        secret_part = hmac.new(salt, json.dumps(sorted(secrets.items())).encode(),
                               hashlib.sha256).hexdigest()
        text = json.dumps([self.to_json(), secret_part], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def parse_volume(context: Mapping[str, str], secrets: Mapping[str, str],
                 mount_group: str = "") -> VolumeSpec:
    """volumeAttributes (+ the capability's volume_mount_group) -> a VolumeSpec."""
    source = context.get("source", "")
    sources = source.split()
    if not sources:
        raise VolumeError("volumeAttributes: 'source' is required: the shards, as `shardfs "
                          "mount` takes SOURCE (several separated by spaces)")
    for source in sources:
        scheme, sep, _ = source.partition("://")
        if not sep or scheme.lower() not in REMOTE_SCHEMES:
            raise VolumeError(f"volumeAttributes: source {source!r}: expected a URL "
                              f"({', '.join(s + '://' for s in REMOTE_SCHEMES)}); local "
                              "paths are not served to pods")
    try:
        pod = parse_pod_identity(context, secrets)
    except PodIdentityError as exc:
        raise VolumeError(str(exc)) from None
    raw: dict[str, Any] = {}
    for key, value in context.items():
        if key == "source" or key in POD_ATTRIBUTES or key.startswith(KUBELET_PREFIX):
            continue
        name = key.replace("-", "_")
        if name in _NOT_SETTABLE:
            raise VolumeError(f"volumeAttributes: {key!r} cannot be set: "
                              f"{_NOT_SETTABLE[name]}")
        raw[name] = value
    try:
        options = validate(raw, "volumeAttributes")
    except ConfigError as exc:
        raise VolumeError(str(exc)) from None
    check_secrets(secrets)
    gid = None
    if mount_group:
        if not mount_group.isdigit():
            raise VolumeError(f"volume_mount_group {mount_group!r}: expected a numeric gid")
        gid = int(mount_group)
    return VolumeSpec(sources=sources, options=options, gid=gid, pod=pod)


def check_secrets(secrets: Mapping[str, str]) -> None:
    unknown = sorted(set(secrets) - set(SECRET_KEYS))
    if unknown:
        raise VolumeError(f"secret keys {', '.join(map(repr, unknown))} are not used by "
                          f"shardfs; allowed: {', '.join(SECRET_KEYS)}")
    google = secrets.get(GOOGLE_CREDENTIALS_JSON)
    if google is not None:
        try:
            kind = json.loads(google).get("type")
        except (ValueError, AttributeError):
            kind = None
        if not isinstance(kind, str):
            raise VolumeError(f"secret key {GOOGLE_CREDENTIALS_JSON}: not a Google "
                              "credentials file (JSON with a \"type\")")


def is_ephemeral(context: Mapping[str, str]) -> bool:
    return context.get(EPHEMERAL, "").lower() == "true"
