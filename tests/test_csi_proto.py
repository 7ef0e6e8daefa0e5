"""The CSI messages (shardfs/csi/proto.py) on the wire, and the checker that compares them
with the spec's csi.proto (shardfs/devtools/csicheck.py; docs/kubernetes.md says how it was
run). No spec text is stored here: the checker is tested on a small proto of our own."""

from __future__ import annotations

import pytest

pytest.importorskip("google.protobuf", reason="protobuf comes with the csi extra")

from shardfs.csi import proto
from shardfs.devtools import csicheck


def test_publish_request_bytes_carry_the_spec_field_numbers() -> None:
    req = proto.NodePublishVolumeRequest(volume_id="v", target_path="/t", readonly=True)
    req.volume_capability.mount.volume_mount_group = "7"
    req.volume_capability.access_mode.mode = proto.VolumeCapability.AccessMode.Mode.Value(
        "SINGLE_NODE_WRITER")
    req.secrets["K"] = "S"
    data = req.SerializeToString()
    # Tags are (field number << 3) | wire type: volume_id 1, target_path 4, capability 5
    # (mount 2 -> volume_mount_group 3; access_mode 3 -> mode 1 = 1), readonly 6, secrets 7.
    assert data.startswith(b"\x0a\x01v" + b"\x22\x02/t" + b"\x2a\x09\x12\x03\x1a\x017"
                           + b"\x1a\x02\x08\x01" + b"\x30\x01" + b"\x3a\x06\x0a\x01K\x12\x01S")
    assert proto.NodePublishVolumeRequest.FromString(data) == req


def test_unknown_fields_of_newer_peers_are_ignored() -> None:
    # NodeGetInfoResponse.accessible_topology (3) is not ours: it must not break parsing.
    data = b"\x0a\x01n" + b"\x1a\x00"
    assert proto.message("NodeGetInfoResponse").FromString(data).node_id == "n"


SPEC_LIKE = """
syntax = "proto3";
package csi.v1;
service Identity {
  rpc GetPluginInfo(GetPluginInfoRequest) returns (GetPluginInfoResponse) {}
}
// a comment { with braces }
message GetPluginInfoResponse {
  string name = 1;
  string vendor_version = 3;   // wrong on purpose
  map<string, string> manifest = 2 [(alpha_field) = true];
}
message NodeServiceCapability {
  message RPC {
    enum Type {
      UNKNOWN = 0;
      VOLUME_MOUNT_GROUP = 5;   // wrong on purpose
    }
    Type type = 1;
  }
  oneof type {
    RPC rpc = 1;
  }
}
"""


def test_the_checker_finds_wrong_numbers() -> None:
    spec = csicheck.parse(SPEC_LIKE)
    assert spec.rpcs["Identity"]["GetPluginInfo"] == ("GetPluginInfoRequest",
                                                      "GetPluginInfoResponse")
    assert spec.messages["NodeServiceCapability.RPC"].enums["Type"]["VOLUME_MOUNT_GROUP"] == 5
    assert spec.messages["NodeServiceCapability"].fields["rpc"] == (1, "RPC", False)
    bad, _ = csicheck.compare(spec)
    assert "GetPluginInfoResponse.vendor_version: number 2, the spec says 3" in bad
    assert "GetPluginInfoResponse.manifest: number 3, the spec says 2" in bad
    assert "NodeServiceCapability.RPC.Type.VOLUME_MOUNT_GROUP = 6, the spec says 5" in bad
    assert not any(line.startswith("NodeServiceCapability.rpc") for line in bad)
    assert any("NodePublishVolumeRequest: not in the spec" in line for line in bad)
