"""Build step for shardfs's C: the pyfuse3/libfuse3 shim (docs/pyfuse3.md) and the thread that
splices HTTP bodies into files (shardfs/sources/_bodysplice.c).

Everything else is in pyproject.toml. The shim is optional: if it cannot be built, shardfs
still works, answering OPEN as before (the slower open-based read path).
"""

import shlex
import subprocess

from setuptools import Extension, setup


def fuse3_cflags() -> list[str]:
    try:
        out = subprocess.run(["pkg-config", "--cflags", "fuse3"], capture_output=True,
                             text=True, check=True).stdout
        return shlex.split(out)
    except (OSError, subprocess.CalledProcessError):
        return ["-I/usr/include/fuse3"]


setup(ext_modules=[
    Extension("shardfs.fuse._shim", ["shardfs/fuse/_shim.c"],
              depends=["shardfs/fuse/_shim_meta.c",  # #included by _shim.c
                       "shardfs/fuse/_shim_arena.c",  # #included by _shim_meta.c
                       "shardfs/fuse/_shim_reader.c"],  # #included by _shim.c
              extra_compile_args=fuse3_cflags(), libraries=["dl", "pthread"], optional=True),
    # HTTP bodies spliced into files by a thread of C (docs/sources.md); optional too: without
    # it the daemon's loop does the splices.
    Extension("shardfs.sources._bodysplice", ["shardfs/sources/_bodysplice.c"],
              libraries=["pthread"], optional=True),
])
