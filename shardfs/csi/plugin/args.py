"""`shardfs csi`'s command line (kept apart from the server: parsing needs no grpcio)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, metavar="unix:///PATH/csi.sock",
                   help="the CSI socket kubelet calls (the node-driver-registrar's "
                   "--csi-address)")
    p.add_argument("--node-id", required=True, metavar="NODE",
                   help="this node's name (spec.nodeName, from the downward API)")
    p.add_argument("--mounter", required=True, metavar="unix:///PATH/mounter.sock",
                   help="where `shardfs csi-mounter` listens")
    p.add_argument("--state-dir", required=True, metavar="DIR",
                   help="volumes, publishes and node mounts; must be a host directory "
                   "shared with the host's mount namespace (e.g. under the kubelet dir)")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"),
                   help="how much goes to stderr (default: info); secrets are never logged")


def run_command(args: argparse.Namespace) -> int:
    """`shardfs csi`: a clear error when the csi extra (grpcio, protobuf) is missing."""
    import sys

    try:
        import grpc  # noqa: F401
        from google import protobuf  # noqa: F401
    except ImportError as exc:
        print(f"shardfs: error: shardfs csi needs grpcio and protobuf (pip install "
              f"'shardfs[csi]'): {exc}", file=sys.stderr)
        return 1
    from shardfs.csi.plugin.server import run

    return run(args)
