"""`shardfs csi-mounter`: runs one shardfs daemon per volume on handed-over FUSE descriptors."""

from shardfs.csi.mounter.args import add_arguments

__all__ = ["add_arguments"]
