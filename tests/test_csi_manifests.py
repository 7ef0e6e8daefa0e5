"""examples/kubernetes/: every manifest validates offline against a current Kubernetes schema
(kubernetes-validate ships the schemas), and what the manifests say agrees with the code:
the driver name, the command lines, the sockets, the propagation the mounts need."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardfs.cli.main import build_parser

kv = pytest.importorskip("kubernetes_validate.utils",
                         reason="kubernetes-validate is a test dependency")

HERE = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
DRIVER = "shardfs.csi.shardfs.io"


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(HERE.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in documents()
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name)
    return found[0]


def test_every_manifest_validates_against_the_latest_schema() -> None:
    version = kv.latest_version()
    docs = documents()
    kinds = {d["kind"] for _, d in docs}
    assert {"CSIDriver", "DaemonSet", "ServiceAccount", "PersistentVolume",
            "PersistentVolumeClaim", "Pod", "Job", "Namespace", "Secret"} <= kinds
    for name, doc in docs:
        try:  # raises on any unknown or mistyped field
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{name}: {doc['kind']}: {exc}") from None
    # The check is real: a misspelt field fails it.
    bad = by_kind("CSIDriver")
    bad = {**bad, "spec": {**bad["spec"], "attachRequird": False}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_the_driver_object_matches_the_plugin() -> None:
    from shardfs.csi.plugin.server import DRIVER_NAME

    spec = by_kind("CSIDriver")["spec"]
    assert by_kind("CSIDriver")["metadata"]["name"] == DRIVER_NAME == DRIVER
    assert spec["attachRequired"] is False and spec["podInfoOnMount"] is True
    assert sorted(spec["volumeLifecycleModes"]) == ["Ephemeral", "Persistent"]
    for kind in ("PersistentVolume",):
        assert by_kind(kind)["spec"]["csi"]["driver"] == DRIVER
    inline = by_kind("Job")["spec"]["template"]["spec"]["volumes"][0]["csi"]
    assert inline["driver"] == DRIVER and inline["volumeAttributes"]["source"]


def _container(daemonset: str, name: str) -> dict[str, Any]:
    pod = by_kind("DaemonSet", daemonset)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def _args(daemonset: str, name: str) -> Any:
    argv = [a.replace("$(NODE_NAME)", "node-1") for a in _container(daemonset, name)["args"]]
    return build_parser().parse_args(argv)


def _mounts(daemonset: str, name: str) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in _container(daemonset, name)["volumeMounts"]}


def test_the_daemonsets_run_our_commands_with_consistent_paths() -> None:
    plugin = _args("shardfs-csi-node", "shardfs-csi")
    mounter = _args("shardfs-csi-mounter", "shardfs-mounter")
    assert plugin.command == "csi" and mounter.command == "csi-mounter"
    plugin_dir = f"/var/lib/kubelet/plugins/{DRIVER}"
    # The plugin reaches the mounter's socket: /csi is the plugin dir in the plugin's pod.
    assert plugin.mounter.replace("unix:///csi/", f"unix://{plugin_dir}/") == mounter.listen
    # The registrar tells kubelet the host path of the plugin's socket.
    registrar = _container("shardfs-csi-node", "node-driver-registrar")["args"]
    assert f"--kubelet-registration-path={plugin_dir}/csi.sock" in registrar
    assert plugin.endpoint == "unix:///csi/csi.sock"
    # Node mounts (the state dir) and pods' targets propagate to the host: Bidirectional.
    mounts = _mounts("shardfs-csi-node", "shardfs-csi")
    assert plugin.state_dir.startswith(plugin_dir + "/")
    assert mounts[plugin_dir]["mountPropagation"] == "Bidirectional"
    assert mounts["/var/lib/kubelet/pods"]["mountPropagation"] == "Bidirectional"
    assert "/dev/fuse" in mounts
    assert _container("shardfs-csi-node", "shardfs-csi")["securityContext"]["privileged"]
    # The mounter sees the node mounts, and has no privilege at all.
    mmounts = _mounts("shardfs-csi-mounter", "shardfs-mounter")
    assert mmounts[plugin_dir]["mountPropagation"] == "HostToContainer"
    assert mounter.state_dir in mmounts and mounter.cache_root in mmounts
    sc = _container("shardfs-csi-mounter", "shardfs-mounter")["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The liveness probe's sidecar calls Probe on the same socket.
    probe = _container("shardfs-csi-node", "livenessprobe")["args"]
    assert "--csi-address=/csi/csi.sock" in probe


def test_the_containerfile_installs_the_csi_extra() -> None:
    text = (HERE / "Containerfile").read_text()
    extras = tomllib.loads((HERE.parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert "grpcio" in " ".join(extras["csi"])
    install = next(line for line in text.splitlines() if "pip install" in line)
    assert "[csi" in install, install
    entry = next(line for line in text.splitlines() if line.startswith("ENTRYPOINT"))
    assert "shardfs" in shlex.split(entry.replace(",", " ").strip("[]"))[-1]
