"""`shardfs csi`: the CSI Identity and Node services on a Unix socket (gRPC, grpcio).

Handlers are registered by method path with the message classes of `shardfs.csi.proto`
(no generated stubs). Every request is logged without its secrets.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

from shardfs import __version__
from shardfs.csi import proto, wire
from shardfs.csi.plugin.node import Node, NodeError, PublishRequest
from shardfs.csi.podidentity import SERVICE_ACCOUNT_TOKENS

log = logging.getLogger(__name__)

DRIVER_NAME = "shardfs.csi.shardfs.io"
MAX_VOLUMES_PER_NODE = 0  # 0: no limit of ours


class Plugin:
    def __init__(self, node_id: str, node: Node) -> None:
        self.node_id = node_id
        self.node = node

    # -- Identity ------------------------------------------------------------------------
    def GetPluginInfo(self, request: Any, context: Any) -> Any:
        return proto.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:
        return proto.GetPluginCapabilitiesResponse()  # node service only: no controller

    def Probe(self, request: Any, context: Any) -> Any:
        response = proto.ProbeResponse()
        response.ready.value = True
        return response

    # -- Node ----------------------------------------------------------------------------
    def NodeGetInfo(self, request: Any, context: Any) -> Any:
        return proto.NodeGetInfoResponse(node_id=self.node_id,
                                         max_volumes_per_node=MAX_VOLUMES_PER_NODE)

    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:
        rpc = proto.NodeServiceCapability
        response = proto.NodeGetCapabilitiesResponse()
        cap = response.capabilities.add()
        cap.rpc.type = rpc.RPC.VOLUME_MOUNT_GROUP  # fsGroup reaches us; no staging
        return response

    def NodePublishVolume(self, request: Any, context: Any) -> Any:
        has_cap = request.HasField("volume_capability")
        cap = request.volume_capability
        req = PublishRequest(
            volume_id=request.volume_id, target_path=request.target_path,
            context=dict(request.volume_context), secrets=dict(request.secrets),
            mount_group=cap.mount.volume_mount_group if has_cap else "",
            readonly=request.readonly, has_capability=has_cap,
            block=has_cap and cap.WhichOneof("access_type") == "block")
        # A pod's service account token is a credential: named, never shown. With
        # requiresRepublish kubelet repeats this call every minute or so: debug.
        shown = {k: ("(a token)" if k == SERVICE_ACCOUNT_TOKENS else v)
                 for k, v in req.context.items()}
        log.debug("NodePublishVolume %s -> %s (attributes %s, secrets: %d key(s))",
                  req.volume_id, req.target_path, shown, len(req.secrets))
        self._call(context, self.node.publish, req)
        return proto.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:
        log.info("NodeUnpublishVolume %s from %s", request.volume_id, request.target_path)
        self._call(context, self.node.unpublish, request.volume_id, request.target_path)
        return proto.NodeUnpublishVolumeResponse()

    @staticmethod
    def _call(context: Any, fn: Any, *args: Any) -> None:
        import grpc

        try:
            fn(*args)
        except NodeError as exc:
            log.warning("%s: %s", exc.code, exc)
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))


def _handlers(plugin: Plugin) -> list[Any]:
    import grpc

    out = []
    for service, methods in proto.SERVICES.items():
        table = {}
        for method, request, response in methods:
            table[method] = grpc.unary_unary_rpc_method_handler(
                getattr(plugin, method),
                request_deserializer=proto.message(request).FromString,
                response_serializer=proto.message(response).SerializeToString)
        out.append(grpc.method_handlers_generic_handler(f"{proto.PACKAGE}.{service}", table))
    return out


def run(args: argparse.Namespace) -> int:
    import grpc

    from shardfs.cli.logsetup import setup_logging

    setup_logging(args.log_level)  # the daemon's format, signed URLs' signatures redacted
    try:
        endpoint = wire.socket_path(args.endpoint)
        wire.socket_path(args.mounter)
    except ValueError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr, flush=True)
        return 1
    node = Node(Path(args.state_dir), args.mounter)
    watch = threading.Thread(target=node.link.run, name="mounter-watch", daemon=True)
    watch.start()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(endpoint)
    os.makedirs(os.path.dirname(endpoint), exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="csi"))
    server.add_generic_rpc_handlers(_handlers(Plugin(args.node_id, node)))
    try:
        bound = server.add_insecure_port(f"unix://{endpoint}")
    except RuntimeError:  # newer grpcio raise instead of returning 0
        bound = 0
    if bound == 0:
        print(f"shardfs: error: cannot listen on {endpoint} (a socket path must be shorter "
              "than 108 bytes, in a writable directory)", file=sys.stderr)
        node.link.stop()
        return 1
    server.start()
    log.info("shardfs csi %s: %s on %s, node %s, mounter %s, state %s", __version__,
             DRIVER_NAME, endpoint, args.node_id, args.mounter, args.state_dir)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    # Mounts stay: they belong to the pods, and a new plugin takes them over.
    log.info("stopping; %d volume(s) stay mounted", len(node.state.volumes))
    node.link.stop()
    server.stop(grace=5).wait()
    return 0
