"""Answering FUSE requests: pyfuse3 Operations and everything pyfuse3-specific.

This is what runs in every process that serves the mount. It reads the immutable tree and the
cache files; it holds no policy — what to fetch is asked of `shardfs.read`.

Import pyfuse3 only after this package: it loads our shim first (see `shim.py`).
"""

from shardfs.fuse import shim as shim  # must precede every `import pyfuse3`
