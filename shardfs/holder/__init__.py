"""The holder: a tiny process that keeps a mount's FUSE connection alive while its daemon dies
or is replaced, and starts the next daemon, which takes the mount over (docs/design.md,
"A mount that outlives its daemon"). No trio, no network, no tree: only descriptors, child
processes and signals.
"""

from shardfs.holder.holder import main as main

__all__ = ["main"]
