"""A volume as a pod declares it: `volumeAttributes` + secrets -> what one daemon serves.

`source` is what `shardfs mount` takes as SOURCE (several separated by spaces); every other
attribute is a key of the YAML config, validated by the config's own rules and messages.
Kubelet's own attributes (`csi.storage.k8s.io/...`: pod name, namespace, uid, service account,
ephemeral) are not part of the volume: two pods naming the same shards with the same settings
and credentials share one daemon and one cache (the volume's `key`).

Pod-level AWS credentials (`authentication_source: pod`, with `aws_role_arn`): the volume's
daemon assumes that role with the pod's own service account token (kubelet passes it when the
CSIDriver object has `tokenRequests` for audience `sts.amazonaws.com`; `requiresRepublish`
brings fresh ones), as IRSA does for a pod's own processes. The volume is then keyed by the
pod's namespace and service account (not its token): pods of one service account share a
daemon, pods of another get their own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardfs.cli.config import ConfigError, validate

KUBELET_PREFIX = "csi.storage.k8s.io/"
EPHEMERAL = KUBELET_PREFIX + "ephemeral"
POD_NAMESPACE = KUBELET_PREFIX + "pod.namespace"
SERVICE_ACCOUNT = KUBELET_PREFIX + "serviceAccount.name"
SERVICE_ACCOUNT_TOKENS = KUBELET_PREFIX + "serviceAccount.tokens"
STS_AUDIENCE = "sts.amazonaws.com"  # the audience IRSA's tokens carry

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
    # Pod-level AWS credentials (authentication_source: pod): the role the daemon assumes
    # with the pod's token, and whose pods these are ("NAMESPACE/SERVICE_ACCOUNT").
    role_arn: str | None = None
    service_account: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VolumeSpec:
        return cls(sources=list(data["sources"]), options=dict(data.get("options") or {}),
                   gid=data.get("gid"), role_arn=data.get("role_arn"),
                   service_account=data.get("service_account"))

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
    role_arn, service_account = _pod_identity(context, secrets)
    raw: dict[str, Any] = {}
    for key, value in context.items():
        if key in ("source", "authentication_source", "aws_role_arn") or \
                key.startswith(KUBELET_PREFIX):
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
    return VolumeSpec(sources=sources, options=options, gid=gid, role_arn=role_arn,
                      service_account=service_account)


def _pod_identity(context: Mapping[str, str], secrets: Mapping[str, str]
                  ) -> tuple[str | None, str | None]:
    """(role ARN, "NAMESPACE/SERVICE_ACCOUNT") for `authentication_source: pod`; (None, None)
    for the driver's own credentials (the default)."""
    source = context.get("authentication_source", "driver")
    if source not in ("driver", "pod"):
        raise VolumeError(f"volumeAttributes: authentication_source {source!r}: expected "
                          "'driver' (the mounter's credentials or the secret's) or 'pod' "
                          "(the pod's service account token)")
    role_arn = context.get("aws_role_arn")
    if source == "driver":
        if role_arn is not None:
            raise VolumeError("volumeAttributes: aws_role_arn is used only with "
                              "authentication_source: pod")
        return None, None
    if not role_arn or not role_arn.startswith("arn:") or ":role/" not in role_arn:
        raise VolumeError("volumeAttributes: authentication_source: pod needs aws_role_arn, "
                          "the IAM role the pod's service account may assume (e.g. "
                          "arn:aws:iam::123456789012:role/trainer)")
    namespace, account = context.get(POD_NAMESPACE), context.get(SERVICE_ACCOUNT)
    if not namespace or not account:
        raise VolumeError("authentication_source: pod needs the pod's namespace and service "
                          "account: set podInfoOnMount: true in the CSIDriver object")
    mixed = sorted(k for k in secrets if k.startswith("AWS_"))
    if mixed:
        raise VolumeError(f"authentication_source: pod and AWS keys in the secret "
                          f"({', '.join(mixed)}): use one or the other")
    return role_arn, f"{namespace}/{account}"


def pod_token(context: Mapping[str, str]) -> str:
    """The pod's service account token for STS, from kubelet's `serviceAccount.tokens`."""
    text = context.get(SERVICE_ACCOUNT_TOKENS)
    try:
        token = json.loads(text)[STS_AUDIENCE]["token"] if text else None
    except (ValueError, KeyError, TypeError):
        token = None
    if not isinstance(token, str) or not token:
        raise VolumeError(f"authentication_source: pod, but kubelet passed no service "
                          f"account token for audience {STS_AUDIENCE}: the CSIDriver object "
                          f"needs tokenRequests: [{{audience: {STS_AUDIENCE}}}] (and "
                          "requiresRepublish: true, so that tokens are renewed)")
    return token


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
