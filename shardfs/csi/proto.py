"""The CSI v1 messages shardfs uses, built as protobuf descriptors in Python.

Only the messages, fields and enum values a node-only plugin sends or reads are defined, with
the spec's package (`csi.v1`), names and field numbers, so that they are wire compatible with
kubelet and the sidecars. Nothing is generated and the spec's `csi.proto` is not in the
repository: the table below is ours, written from the spec's text and checked against it with
`python -m shardfs.devtools.csicheck PATH/TO/csi.proto` (docs/kubernetes.md, "Wire
compatibility"). Fields and values the spec has and we leave out arrive as unknown fields and
are ignored, as protobuf does for any newer peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, wrappers_pb2

PACKAGE = "csi.v1"
FILE_NAME = "shardfs/csi/csi_v1_subset.proto"  # our name: never clashes with the spec's file

_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _FDP.TYPE_STRING, "bool": _FDP.TYPE_BOOL, "int64": _FDP.TYPE_INT64}


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    number: int
    type: str  # "string" | "bool" | "int64" | "map" (map<string, string>) | a message/enum name
    repeated: bool = False
    oneof: str | None = None
    enum: bool = False  # `type` names an enum


@dataclass(frozen=True, slots=True)
class Message:
    name: str
    fields: tuple[Field, ...] = ()
    nested: tuple[Message, ...] = ()
    enums: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()  # (name, ((value, n), ...))


# -- the subset of csi.v1 ------------------------------------------------------------------
_ACCESS_MODES = (("UNKNOWN", 0), ("SINGLE_NODE_WRITER", 1), ("SINGLE_NODE_READER_ONLY", 2),
                 ("MULTI_NODE_READER_ONLY", 3), ("MULTI_NODE_SINGLE_WRITER", 4),
                 ("MULTI_NODE_MULTI_WRITER", 5), ("SINGLE_NODE_SINGLE_WRITER", 6),
                 ("SINGLE_NODE_MULTI_WRITER", 7))

MESSAGES: tuple[Message, ...] = (
    Message("GetPluginInfoRequest"),
    Message("GetPluginInfoResponse", (
        Field("name", 1, "string"), Field("vendor_version", 2, "string"),
        Field("manifest", 3, "map"))),
    Message("GetPluginCapabilitiesRequest"),
    Message("GetPluginCapabilitiesResponse", (
        Field("capabilities", 1, ".csi.v1.PluginCapability", repeated=True),)),
    Message("PluginCapability",
            (Field("service", 1, ".csi.v1.PluginCapability.Service", oneof="type"),),
            nested=(Message(
                "Service", (Field("type", 1, ".csi.v1.PluginCapability.Service.Type",
                                  enum=True),),
                enums=(("Type", (("UNKNOWN", 0), ("CONTROLLER_SERVICE", 1),
                                 ("VOLUME_ACCESSIBILITY_CONSTRAINTS", 2),
                                 ("GROUP_CONTROLLER_SERVICE", 3))),)),)),
    Message("ProbeRequest"),
    Message("ProbeResponse", (Field("ready", 1, ".google.protobuf.BoolValue"),)),
    Message("VolumeCapability", (
        Field("block", 1, ".csi.v1.VolumeCapability.BlockVolume", oneof="access_type"),
        Field("mount", 2, ".csi.v1.VolumeCapability.MountVolume", oneof="access_type"),
        Field("access_mode", 3, ".csi.v1.VolumeCapability.AccessMode")),
        nested=(
            Message("BlockVolume"),
            Message("MountVolume", (
                Field("fs_type", 1, "string"), Field("mount_flags", 2, "string", repeated=True),
                Field("volume_mount_group", 3, "string"))),
            Message("AccessMode",
                    (Field("mode", 1, ".csi.v1.VolumeCapability.AccessMode.Mode", enum=True),),
                    enums=(("Mode", _ACCESS_MODES),)),
        )),
    Message("NodePublishVolumeRequest", (
        Field("volume_id", 1, "string"), Field("publish_context", 2, "map"),
        Field("staging_target_path", 3, "string"), Field("target_path", 4, "string"),
        Field("volume_capability", 5, ".csi.v1.VolumeCapability"),
        Field("readonly", 6, "bool"), Field("secrets", 7, "map"),
        Field("volume_context", 8, "map"))),
    Message("NodePublishVolumeResponse"),
    Message("NodeUnpublishVolumeRequest", (
        Field("volume_id", 1, "string"), Field("target_path", 2, "string"))),
    Message("NodeUnpublishVolumeResponse"),
    Message("NodeGetCapabilitiesRequest"),
    Message("NodeGetCapabilitiesResponse", (
        Field("capabilities", 1, ".csi.v1.NodeServiceCapability", repeated=True),)),
    Message("NodeServiceCapability",
            (Field("rpc", 1, ".csi.v1.NodeServiceCapability.RPC", oneof="type"),),
            nested=(Message(
                "RPC", (Field("type", 1, ".csi.v1.NodeServiceCapability.RPC.Type",
                              enum=True),),
                enums=(("Type", (("UNKNOWN", 0), ("STAGE_UNSTAGE_VOLUME", 1),
                                 ("GET_VOLUME_STATS", 2), ("EXPAND_VOLUME", 3),
                                 ("VOLUME_CONDITION", 4), ("SINGLE_NODE_MULTI_WRITER", 5),
                                 ("VOLUME_MOUNT_GROUP", 6))),)),)),
    Message("NodeGetInfoRequest"),
    Message("NodeGetInfoResponse", (
        Field("node_id", 1, "string"), Field("max_volumes_per_node", 2, "int64"))),
)

# service -> ((method, request, response), ...): the rpcs this plugin serves.
SERVICES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "Identity": (
        ("GetPluginInfo", "GetPluginInfoRequest", "GetPluginInfoResponse"),
        ("GetPluginCapabilities", "GetPluginCapabilitiesRequest",
         "GetPluginCapabilitiesResponse"),
        ("Probe", "ProbeRequest", "ProbeResponse"),
    ),
    "Node": (
        ("NodePublishVolume", "NodePublishVolumeRequest", "NodePublishVolumeResponse"),
        ("NodeUnpublishVolume", "NodeUnpublishVolumeRequest", "NodeUnpublishVolumeResponse"),
        ("NodeGetCapabilities", "NodeGetCapabilitiesRequest", "NodeGetCapabilitiesResponse"),
        ("NodeGetInfo", "NodeGetInfoRequest", "NodeGetInfoResponse"),
    ),
}


# -- building the descriptors --------------------------------------------------------------
def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _fill(out: descriptor_pb2.DescriptorProto, msg: Message, scope: str) -> None:
    """Describe `msg` into `out`; `scope` is its full name (csi.v1.Outer.Inner)."""
    out.name = msg.name
    for sub in msg.nested:
        _fill(out.nested_type.add(), sub, f"{scope}.{sub.name}")
    for enum_name, values in msg.enums:
        enum = out.enum_type.add(name=enum_name)
        for value, number in values:
            enum.value.add(name=value, number=number)
    oneofs: list[str] = []
    for f in msg.fields:
        camel = _camel(f.name)
        fd = out.field.add(name=f.name, number=f.number, json_name=camel[:1].lower() + camel[1:])
        if f.type == "map":
            # A proto3 map is a repeated nested XxxEntry message {key = 1; value = 2}.
            entry = out.nested_type.add(name=_camel(f.name) + "Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_FDP.TYPE_STRING,
                            label=_FDP.LABEL_OPTIONAL, json_name="key")
            entry.field.add(name="value", number=2, type=_FDP.TYPE_STRING,
                            label=_FDP.LABEL_OPTIONAL, json_name="value")
            fd.type = _FDP.TYPE_MESSAGE
            fd.type_name = f".{scope}.{entry.name}"
            fd.label = _FDP.LABEL_REPEATED
            continue
        fd.label = _FDP.LABEL_REPEATED if f.repeated else _FDP.LABEL_OPTIONAL
        if f.type in _SCALARS:
            fd.type = _SCALARS[f.type]
        else:
            fd.type = _FDP.TYPE_ENUM if f.enum else _FDP.TYPE_MESSAGE
            fd.type_name = f.type
        if f.oneof is not None:
            if f.oneof not in oneofs:
                oneofs.append(f.oneof)
                out.oneof_decl.add(name=f.oneof)
            fd.oneof_index = oneofs.index(f.oneof)


def file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    fdp.dependency.append(wrappers_pb2.DESCRIPTOR.name)
    for msg in MESSAGES:
        _fill(fdp.message_type.add(), msg, f"{PACKAGE}.{msg.name}")
    for service, methods in SERVICES.items():
        sd = fdp.service.add(name=service)
        for method, request, response in methods:
            sd.method.add(name=method, input_type=f".{PACKAGE}.{request}",
                          output_type=f".{PACKAGE}.{response}")
    return fdp


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(file_descriptor_proto().SerializeToString())
    try:
        from google.protobuf.message_factory import GetMessageClass
    except ImportError:  # protobuf < 4.21
        from google.protobuf.message_factory import MessageFactory

        GetMessageClass = MessageFactory(pool).GetPrototype
    return {m.name: GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{m.name}"))
            for m in MESSAGES}


_CLASSES = _build()


def message(name: str) -> Any:
    """The generated class of csi.v1.NAME (top-level messages only)."""
    return _CLASSES[name]


def method_path(service: str, method: str) -> str:
    """The gRPC path, as kubelet calls it: /csi.v1.Node/NodePublishVolume."""
    return f"/{PACKAGE}.{service}/{method}"


# The classes by name, for code that builds and reads requests.
GetPluginInfoResponse = _CLASSES["GetPluginInfoResponse"]
GetPluginCapabilitiesResponse = _CLASSES["GetPluginCapabilitiesResponse"]
ProbeResponse = _CLASSES["ProbeResponse"]
VolumeCapability = _CLASSES["VolumeCapability"]
NodePublishVolumeRequest = _CLASSES["NodePublishVolumeRequest"]
NodePublishVolumeResponse = _CLASSES["NodePublishVolumeResponse"]
NodeUnpublishVolumeRequest = _CLASSES["NodeUnpublishVolumeRequest"]
NodeUnpublishVolumeResponse = _CLASSES["NodeUnpublishVolumeResponse"]
NodeGetCapabilitiesResponse = _CLASSES["NodeGetCapabilitiesResponse"]
NodeServiceCapability = _CLASSES["NodeServiceCapability"]
NodeGetInfoResponse = _CLASSES["NodeGetInfoResponse"]
