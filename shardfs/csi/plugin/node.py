"""The node plugin's volumes: publish (mount once per volume, bind into each pod) and
unpublish (unbind; the last one unmounts and releases the daemon), plus what a restarted
plugin finds on the node.

One FUSE mount per volume key at STATE_DIR/mounts/KEY: the plugin opens /dev/fuse, mounts it
there with fd=N and hands the descriptor to the mounter, whose daemon answers INIT; a publish
returns only once the mounter says the daemon is ready and the mount answers statvfs. Every
pod's target path is a read-only bind of that mount.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from shardfs.csi.plugin import kernel
from shardfs.csi.plugin.link import Descriptors, MounterLink, MounterUnavailable
from shardfs.csi.plugin.state import PluginState, Publish, Volume
from shardfs.csi.podidentity import PodIdentityError, pod_token
from shardfs.csi.volume import VolumeError, VolumeSpec, is_ephemeral, parse_volume

log = logging.getLogger(__name__)

SERVE_TIMEOUT_S = 1800.0  # indexing a large dataset the first time takes a while


class NodeError(Exception):
    """An error for the CSI caller; `code` names a grpc.StatusCode member."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PublishRequest:
    volume_id: str
    target_path: str
    context: dict[str, str]
    secrets: dict[str, str]
    mount_group: str
    readonly: bool
    has_capability: bool
    block: bool


class Node:
    def __init__(self, state_dir: Path, mounter: str) -> None:
        self.state = PluginState(state_dir)
        self.descriptors = Descriptors()
        self.link = MounterLink(mounter, self.descriptors, self._known, self._given_up)
        self._key_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._recover()

    def _known(self) -> dict[str, dict]:
        with self.state.lock:
            return {k: v.spec.to_json() for k, v in self.state.volumes.items()}

    def _given_up(self, key: str) -> None:
        """The mounter gave the volume up (its daemon kept dying): drop our descriptor, so
        that the connection ends and readers get an error rather than wait forever, and
        detach the node mount; pods' binds go with their unpublish, a new publish mounts
        afresh."""
        log.error("volume %s: the mounter gave it up (its daemon kept dying); ending the "
                  "mount", key)
        with self._key_locks[key]:
            self.descriptors.drop(key)
            with self.state.lock:
                volume = self.state.volumes.get(key)
            if volume is not None:
                with contextlib.suppress(OSError):
                    kernel.unmount(volume.node_path)

    # -- restart -------------------------------------------------------------------------
    def _recover(self) -> None:
        """After a restart: keep the volumes whose node mount is still there and alive (the
        mounter hands their descriptors back on the first sync); forget those whose node
        mount is gone (a reboot), unmount those whose connection is dead, drop publishes
        whose bind is gone, and release volumes no pod uses."""
        changed = False
        with self.state.lock:
            mounted = [v.node_path for v in self.state.volumes.values()
                       if kernel.mount_at(v.node_path) is not None]
            alive = kernel.answers(mounted, timeout=2.0)
            for key, volume in list(self.state.volumes.items()):
                if kernel.mount_at(volume.node_path) is None:
                    log.warning("volume %s: its node mount %s is gone (node restarted?); "
                                "forgetting it", key, volume.node_path)
                    for target in volume.publishes:
                        with contextlib.suppress(OSError):
                            kernel.unmount(target)
                    del self.state.volumes[key]
                    changed = True
                    continue
                if alive.get(volume.node_path) is False:
                    # Its connection ended (every holder died): a dead mount, not a waiting one.
                    log.warning("volume %s: its mount %s is dead (both the plugin and the "
                                "mounter ended?); unmounting it and its pods' binds", key,
                                volume.node_path)
                    for target in volume.publishes:
                        with contextlib.suppress(OSError):
                            kernel.unmount(target)
                    with contextlib.suppress(OSError):
                        kernel.unmount(volume.node_path)
                    del self.state.volumes[key]
                    changed = True
                    continue
                for target in list(volume.publishes):
                    if kernel.mount_at(target) is None:
                        log.warning("volume %s: %s is no longer mounted; forgetting it",
                                    key, target)
                        del volume.publishes[target]
                        changed = True
            if changed:
                self.state.save()
            unused = [v for v in self.state.volumes.values() if not v.publishes]
        for volume in unused:  # a publish the earlier plugin did not finish, or a lost pod
            log.info("volume %s: mounted, but no pod uses it; releasing it", volume.key)
            self._forget(volume)
        if self.state.volumes:
            log.info("found %d volume(s) mounted by an earlier plugin, %d publish(es)",
                     len(self.state.volumes),
                     sum(len(v.publishes) for v in self.state.volumes.values()))

    # -- publish -------------------------------------------------------------------------
    def publish(self, req: PublishRequest) -> None:
        if not req.volume_id:
            raise NodeError("INVALID_ARGUMENT", "volume_id is missing")
        if not req.target_path:
            raise NodeError("INVALID_ARGUMENT", "target_path is missing")
        if not req.has_capability:
            raise NodeError("INVALID_ARGUMENT", "volume_capability is missing")
        if req.block:
            raise NodeError("INVALID_ARGUMENT", "shardfs volumes are filesystems: block "
                            "access is not supported (use volumeMode: Filesystem)")
        if not os.path.isabs(req.target_path):
            raise NodeError("INVALID_ARGUMENT", f"target_path {req.target_path!r} is not "
                            "absolute")
        try:
            spec = parse_volume(req.context, req.secrets, req.mount_group)
            # The pod's own token (authentication_source: pod), never part of the key.
            token = pod_token(req.context, spec.pod) if spec.pod is not None else None
        except (VolumeError, PodIdentityError) as exc:
            raise NodeError("INVALID_ARGUMENT", str(exc)) from None
        key = spec.key(req.secrets, self.state.salt)
        target = os.path.normpath(req.target_path)
        wanted = Publish(req.volume_id, req.readonly, is_ephemeral(req.context))
        with self._key_locks[key]:
            found = self.state.find_target(target)
            if found is not None:
                volume, publish = found
                if volume.key == key and publish.volume_id == wanted.volume_id and \
                        publish.readonly == wanted.readonly:
                    if kernel.mount_at(target) is not None:
                        # Already published just so: idempotent. With requiresRepublish,
                        # kubelet calls again with the pod's renewed token.
                        if token is not None:
                            self._renew_token(key, token)
                        return
                else:
                    raise NodeError("ALREADY_EXISTS", f"{target} is already published with "
                                    f"other arguments (volume {publish.volume_id})")
            volume, served = self._ensure_mounted(key, spec, req.secrets, token)
            if token is not None and not served:  # another pod's volume: this pod's token
                self._renew_token(key, token)
            try:
                os.makedirs(target, exist_ok=True)
                if kernel.mount_at(target) is None:
                    kernel.bind_read_only(volume.node_path, target)
            except OSError as exc:
                self._release_if_unused(volume)
                raise NodeError("INTERNAL", f"cannot bind the volume into {target}: "
                                f"{exc.strerror}") from None
            with self.state.lock:
                volume.publishes[target] = wanted
                self.state.save()
        log.info("published volume %s (%s) at %s", req.volume_id, key, target)

    def _ensure_mounted(self, key: str, spec: VolumeSpec, secrets: dict[str, str],
                        token: str | None) -> tuple[Volume, bool]:
        """The volume's node mount, made and served if it is not there yet (then True)."""
        with self.state.lock:
            volume = self.state.volumes.get(key)
        if volume is not None and kernel.mount_at(volume.node_path) is not None:
            return volume, False
        node_path = self.state.node_path(key)
        if volume is None:  # (else a given-up volume, mounted again with its publishes)
            volume = Volume(key, spec, node_path)
            with self.state.lock:  # recorded before it exists: a restart finds what to clean
                self.state.volumes[key] = volume
                self.state.save()
        try:
            os.makedirs(node_path, exist_ok=True)
            try:
                fd = kernel.mount_fuse(node_path)
            except OSError as exc:
                raise NodeError("INTERNAL", f"cannot mount FUSE at {node_path}: "
                                f"{exc.strerror}") from None
            self.descriptors.put(key, fd)
            try:
                reply = self.link.request(
                    {"op": "serve", "key": key, "spec": spec.to_json(), "secrets": secrets,
                     "node_path": node_path, "token": token}, (fd,), timeout=SERVE_TIMEOUT_S)
            except MounterUnavailable as exc:
                raise NodeError("UNAVAILABLE", str(exc)) from None
            if not reply.get("ok"):
                raise NodeError(reply.get("code") or "INTERNAL",
                                reply.get("error") or "the mounter could not serve the volume")
            if kernel.answers([node_path], timeout=30.0)[node_path] is not True:
                raise NodeError("INTERNAL", f"the mount at {node_path} does not answer")
        except BaseException:
            self._forget(volume)
            raise
        log.info("volume %s mounted at %s", key, node_path)
        return volume, True

    def _renew_token(self, key: str, token: str) -> None:
        """Hand a pod's newer service account token to the volume's daemon (through the
        mounter, which rewrites the token file the daemon reads at its next STS call)."""
        try:
            reply = self.link.request({"op": "token", "key": key, "token": token},
                                      timeout=30.0)
        except MounterUnavailable as exc:
            raise NodeError("UNAVAILABLE", str(exc)) from None
        if not reply.get("ok"):
            raise NodeError(reply.get("code") or "INTERNAL",
                            reply.get("error") or "the mounter could not take the token")

    # -- unpublish -----------------------------------------------------------------------
    def unpublish(self, volume_id: str, target_path: str) -> None:
        if not volume_id:
            raise NodeError("INVALID_ARGUMENT", "volume_id is missing")
        if not target_path:
            raise NodeError("INVALID_ARGUMENT", "target_path is missing")
        target = os.path.normpath(target_path)
        found = self.state.find_target(target)
        if found is None:
            # Not ours (any more): make sure nothing of ours is left there. Idempotent.
            entry = kernel.mount_at(target)
            if entry is not None and entry.fstype == kernel.FSTYPE:
                self._unbind(target)
            self._remove_target(target)
            return
        volume, publish = found
        if publish.volume_id != volume_id:
            log.warning("unpublish of %s names volume %s; it was published as %s",
                        target, volume_id, publish.volume_id)
        with self._key_locks[volume.key]:
            self._unbind(target)
            self._remove_target(target)
            with self.state.lock:
                volume.publishes.pop(target, None)
                self.state.save()
            log.info("unpublished volume %s from %s", volume_id, target)
            self._release_if_unused(volume)

    def _unbind(self, target: str) -> None:
        try:
            kernel.unmount(target)
        except OSError as exc:
            raise NodeError("INTERNAL", f"cannot unmount {target}: {exc.strerror}") from None

    @staticmethod
    def _remove_target(target: str) -> None:
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTDIR:
                raise NodeError("INTERNAL", f"cannot remove {target}: {exc.strerror}") from None

    def _release_if_unused(self, volume: Volume) -> None:
        with self.state.lock:
            if volume.publishes or self.state.volumes.get(volume.key) is not volume:
                return
        self._forget(volume)
        log.info("volume %s released (no pod uses it)", volume.key)

    def _forget(self, volume: Volume) -> None:
        """Unmount the node mount (its daemon ends), stop the daemon, drop the record."""
        with contextlib.suppress(OSError):
            kernel.unmount(volume.node_path)
        try:
            self.link.request({"op": "release", "key": volume.key}, timeout=60.0)
        except MounterUnavailable as exc:
            # The mounter forgets it on its next sync: we no longer list the volume.
            log.warning("volume %s: %s; the mounter drops it when it comes back",
                        volume.key, exc)
        self.descriptors.drop(volume.key)
        with contextlib.suppress(OSError):
            os.rmdir(volume.node_path)
        with self.state.lock:
            if self.state.volumes.get(volume.key) is volume:
                del self.state.volumes[volume.key]
                self.state.save()
