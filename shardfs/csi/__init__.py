"""Kubernetes: a CSI node driver. `plugin/` is `shardfs csi` (privileged: mounts, binds into
pods), `mounter/` is `shardfs csi-mounter` (unprivileged: one daemon per volume on descriptors
the plugin hands it). Shared here: the CSI messages (`proto`), the plugin <-> mounter channel
(`wire`) and what a volume is (`volume`). See docs/kubernetes.md.
"""
