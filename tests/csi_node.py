"""A node for the CSI driver's tests: a kubelet directory shared as with Bidirectional
propagation, the plugin and the mounter run as containers would run them, and a test kubelet
that calls the plugin's socket in kubelet's order.

- `KubeletDir`: a fresh directory under /tmp (traversable, so a reader of another uid can
  reach pods' volumes), bind-mounted on itself and made rshared: mounts made below it in
  another mount namespace appear here, as kubelet's dir does with Bidirectional propagation.
  Teardown detaches every mount left below it and the bind itself.
- `Container`: a command in its own PID and mount namespace with its own /proc (`unshare
  --pid --fork --mount-proc --propagation unchanged`, so the shared dir stays shared); `kill()`
  kills the namespace's init, which takes every process of the namespace with it.
- `Kubelet`: GetPluginInfo, NodeGetInfo, NodeGetCapabilities on registration; publish into
  `<root>/pods/<uid>/volumes/kubernetes.io~csi/<name>/mount` (its parent made first and
  vol_data.json written, as kubelet does), unpublish and the removal of that parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is the CSI driver's dependency (extra csi)")

from shardfs.csi import proto  # noqa: E402
from shardfs.csi.plugin import kernel  # noqa: E402

DRIVER = "shardfs.csi.shardfs.io"
SHARDFS = [sys.executable, "-m", "shardfs"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="the CSI plugin mounts: needs root and /dev/fuse")


class KubeletDir:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="shardfs-kubelet-", dir="/tmp"))
        os.chmod(self.root, 0o755)
        subprocess.run(["mount", "--bind", str(self.root), str(self.root)], check=True)
        subprocess.run(["mount", "--make-rshared", str(self.root)], check=True)

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins" / DRIVER

    def mounts_below(self) -> list[kernel.MountEntry]:
        prefix = str(self.root) + "/"
        return [m for m in kernel.mounts() if m.mountpoint.startswith(prefix)]

    def cleanup(self) -> None:
        for entry in sorted(self.mounts_below(), key=lambda m: -len(m.mountpoint)):
            if entry.fstype == kernel.FSTYPE:
                _abort_connection(entry)
            with contextlib.suppress(OSError):
                kernel._libc.umount2(entry.mountpoint.encode(), kernel.MNT_DETACH)
        subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _abort_connection(entry: kernel.MountEntry) -> None:
    """Nothing may hang on a mount a failed test left without a daemon."""
    path = Path("/sys/fs/fuse/connections") / entry.major_minor.split(":")[1] / "abort"
    with contextlib.suppress(OSError):
        path.write_text("1")


class Container:
    """A process in its own PID + mount namespace, as a container runtime starts it."""

    def __init__(self, argv: list[str], log: Path, *, isolated: bool = True) -> None:
        self.log = log
        prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--propagation",
                  "unchanged", "--kill-child"] if isolated else []
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([*prefix, *argv], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.isolated = isolated

    def init_pid(self) -> int:
        """The namespace's PID 1 (unshare's forked child), or the process itself."""
        if not self.isolated:
            return self.proc.pid
        deadline = time.monotonic() + 10
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                children = path.read_text().split()
                if children:
                    return int(children[0])
            time.sleep(0.02)
        raise AssertionError("the container's init did not start")

    def kill(self) -> None:
        """Kill the namespace's init: the kernel kills every process in it."""
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(self.init_pid(), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class NodePaths:
    kubelet: KubeletDir
    work: Path

    @property
    def endpoint(self) -> str:
        return f"unix://{self.kubelet.plugin_dir}/csi.sock"

    @property
    def mounter_socket(self) -> str:
        return f"unix://{self.kubelet.plugin_dir}/mounter.sock"

    @property
    def plugin_state(self) -> Path:
        return self.kubelet.plugin_dir / "state"

    @property
    def mounter_state(self) -> Path:
        return self.work / "mounter-state"

    @property
    def cache_root(self) -> Path:
        return self.work / "cache"


class CsiNode:
    """The plugin and the mounter of one node; restartable; always stopped at teardown."""

    def __init__(self, paths: NodePaths, *, isolated: bool, cache_size: str = "1G",
                 mounter_args: tuple[str, ...] = ()) -> None:
        self.paths = paths
        self.isolated = isolated
        self.cache_size = cache_size
        self.mounter_args = mounter_args
        self.plugin: Container | None = None
        self.mounter: Container | None = None
        self._starts = 0

    def start_mounter(self) -> Container:
        self._starts += 1
        self.mounter = Container(
            [*SHARDFS, "csi-mounter", "--listen", self.paths.mounter_socket,
             "--state-dir", str(self.paths.mounter_state),
             "--cache-root", str(self.paths.cache_root), "--cache-size", self.cache_size,
             *self.mounter_args],
            self.paths.work / f"mounter-{self._starts}.log", isolated=self.isolated)
        return self.mounter

    def start_plugin(self) -> Container:
        self._starts += 1
        self.plugin = Container(
            [*SHARDFS, "csi", "--endpoint", self.paths.endpoint, "--node-id", "node-1",
             "--mounter", self.paths.mounter_socket,
             "--state-dir", str(self.paths.plugin_state)],
            self.paths.work / f"plugin-{self._starts}.log", isolated=self.isolated)
        return self.plugin

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}"
                         for p in sorted(self.paths.work.glob("*.log")))

    def stop(self) -> None:
        for container in (self.plugin, self.mounter):
            if container is not None and container.alive():
                container.kill()


class Kubelet:
    """Calls the plugin's socket as kubelet does."""

    def __init__(self, node: CsiNode) -> None:
        self.node = node
        self.root = node.paths.kubelet.root
        self.channel = grpc.insecure_channel(node.paths.endpoint)

    def close(self) -> None:
        self.channel.close()

    def call(self, service: str, method: str, request: Any = None, timeout: float = 120
             ) -> Any:
        request_name = dict((m, r) for m, r, _ in proto.SERVICES[service])[method]
        response_name = dict((m, r) for m, _, r in proto.SERVICES[service])[method]
        stub = self.channel.unary_unary(
            proto.method_path(service, method),
            request_serializer=proto.message(request_name).SerializeToString,
            response_deserializer=proto.message(response_name).FromString)
        return stub(request if request is not None else proto.message(request_name)(),
                    timeout=timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.call("Identity", "Probe", timeout=2).ready.value:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline or (self.node.plugin and
                                               not self.node.plugin.alive()):
                raise AssertionError("the plugin did not answer Probe:\n" + self.node.logs())
            time.sleep(0.1)

    def register(self) -> dict[str, Any]:
        """What the node-driver-registrar and kubelet ask when the plugin appears."""
        info = self.call("Identity", "GetPluginInfo")
        node = self.call("Node", "NodeGetInfo")
        caps = self.call("Node", "NodeGetCapabilities")
        return {"name": info.name, "version": info.vendor_version, "node_id": node.node_id,
                "capabilities": [c.rpc.type for c in caps.capabilities]}

    def target(self, pod: str, volume: str) -> Path:
        return self.root / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume / "mount"

    def publish(self, pod: str, volume: str, volume_id: str, attributes: dict[str, str],
                *, secrets: dict[str, str] | None = None, ephemeral: bool = False,
                fs_group: str = "", mode: str = "MULTI_NODE_READER_ONLY",
                readonly: bool = True, timeout: float = 120, namespace: str = "default",
                service_account: str = "default",
                tokens: dict[str, str] | None = None) -> Path:
        """`tokens`: audience -> the pod's service account token, as kubelet passes them
        when the CSIDriver object has tokenRequests."""
        target = self.target(pod, volume)
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / "vol_data.json").write_text(json.dumps(
            {"driverName": DRIVER, "volumeHandle": volume_id, "specVolID": volume}))
        req = self.publish_request(volume_id, str(target), attributes, pod=pod,
                                   secrets=secrets, ephemeral=ephemeral, fs_group=fs_group,
                                   mode="SINGLE_NODE_WRITER" if ephemeral else mode,
                                   readonly=readonly and not ephemeral)
        req.volume_context.update({"csi.storage.k8s.io/pod.namespace": namespace,
                                   "csi.storage.k8s.io/serviceAccount.name": service_account})
        if tokens is not None:
            expiry = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            req.volume_context["csi.storage.k8s.io/serviceAccount.tokens"] = json.dumps(
                {aud: {"token": t, "expirationTimestamp": expiry} for aud, t in tokens.items()})
        self.call("Node", "NodePublishVolume", req, timeout=timeout)
        return target

    @staticmethod
    def publish_request(volume_id: str, target: str, attributes: dict[str, str], *,
                        pod: str = "pod", secrets: dict[str, str] | None = None,
                        ephemeral: bool = False, fs_group: str = "",
                        mode: str = "MULTI_NODE_READER_ONLY", readonly: bool = True,
                        capability: bool = True) -> Any:
        req = proto.NodePublishVolumeRequest(volume_id=volume_id, target_path=target,
                                             readonly=readonly)
        if capability:
            req.volume_capability.mount.volume_mount_group = fs_group
            req.volume_capability.access_mode.mode = \
                proto.VolumeCapability.AccessMode.Mode.Value(mode)
        context = dict(attributes)
        # podInfoOnMount: kubelet adds these; they must not split or key the volume.
        context.update({"csi.storage.k8s.io/pod.name": pod,
                        "csi.storage.k8s.io/pod.namespace": "default",
                        "csi.storage.k8s.io/pod.uid": pod,
                        "csi.storage.k8s.io/serviceAccount.name": "default"})
        if ephemeral:
            context["csi.storage.k8s.io/ephemeral"] = "true"
        req.volume_context.update(context)
        req.secrets.update(secrets or {})
        return req

    def unpublish(self, pod: str, volume: str, volume_id: str) -> None:
        target = self.target(pod, volume)
        self.call("Node", "NodeUnpublishVolume",
                  proto.NodeUnpublishVolumeRequest(volume_id=volume_id,
                                                   target_path=str(target)))
        with contextlib.suppress(FileNotFoundError):
            (target.parent / "vol_data.json").unlink()
        with contextlib.suppress(OSError):
            target.parent.rmdir()


@contextlib.contextmanager
def csi_node(tmp_path: Path, *, isolated: bool = False, cache_size: str = "1G",
             mounter_args: tuple[str, ...] = ()) -> Iterator[tuple[CsiNode, Kubelet]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    kubelet_dir = KubeletDir()
    node = CsiNode(NodePaths(kubelet_dir, tmp_path), isolated=isolated, cache_size=cache_size,
                   mounter_args=mounter_args)
    kubelet: Kubelet | None = None
    try:
        node.start_mounter()
        node.start_plugin()
        kubelet = Kubelet(node)
        kubelet.wait_ready()
        yield node, kubelet
    finally:
        if kubelet is not None:
            kubelet.close()
        node.stop()
        kubelet_dir.cleanup()
        _stop_daemons(node.paths.cache_root)


def _stop_daemons(cache_root: Path) -> None:
    """Daemons a failed test left (their mounts are gone: they end by themselves; make sure)."""
    if not cache_root.is_dir():
        return
    for lock in cache_root.glob("*/lock"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(lock.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(lock.parent).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)


def node_mount_count(node: CsiNode) -> int:
    prefix = str(node.paths.plugin_state / "mounts") + "/"
    return sum(1 for m in kernel.mounts()
               if m.mountpoint.startswith(prefix) and m.fstype == kernel.FSTYPE)


def mounter_records(node: CsiNode) -> list[str]:
    return sorted(p.stem for p in (node.paths.mounter_state / "volumes").glob("*.json"))
