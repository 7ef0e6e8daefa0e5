"""`shardfs csi`: the CSI node plugin (Identity + Node services over gRPC)."""

from shardfs.csi.plugin.args import add_arguments

__all__ = ["add_arguments"]
