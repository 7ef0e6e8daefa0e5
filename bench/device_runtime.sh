#!/usr/bin/env bash
# Packs what the lent GPU machine needs to run the daemon and the bench exactly as here, into
# one archive that travels with the working tree (it has no Python packages of ours, nothing
# can be fetched there, and its Python is another version): this machine's Python 3.11
# interpreter and standard library, the venv's packages the daemon imports, the shared
# libraries they link (all but glibc's), nginx and fusermount3, and the shim built here.
#
#   bench/device_runtime.sh [DIR]        # default DIR: .dev (add /.dev/ to .git/info/exclude)
#
# Then, on the device (`run` with carry [".dev"]), from the repository root:
#   bash bench/device_node.sh "$OUT"     # finds DIR/rt.tgz and unpacks it to /tmp/rt
# ~22 MB compressed (the tool's limit for what travels: 64 MiB). Used in session 31
# (docs/scale.md, "The 16-core machine again").
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.dev}
venv=${VENV:-.venv}
py=$(readlink -f "$venv/bin/python")
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
site="$venv/lib/python$ver/site-packages"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
rt=$stage/rt
mkdir -p "$rt/usr/bin" "$rt/usr/lib" "$rt/site" "$rt/lib" "$rt/bin"

cp "$py" "$rt/usr/bin/python$ver"
ln -s "python$ver" "$rt/usr/bin/python3"
(cd "$(dirname "$("$py" -c 'import os; print(os.__file__)')")/.." && \
  tar cf - --exclude=__pycache__ --exclude="python$ver/test" --exclude="python$ver/idlelib" \
    --exclude="python$ver/tkinter" --exclude="python$ver/turtledemo" \
    --exclude="python$ver/ensurepip" --exclude="python$ver/lib2to3" \
    --exclude="python$ver/config-$ver-*" --exclude="python$ver/site-packages" \
    --exclude="python$ver/dist-packages" "python$ver") | (cd "$rt/usr/lib" && tar xf -)
# The daemon's imports (pyproject's dependencies without the credential libraries, which
# the bench's file:// and http:// sources never import) and what they import.
for p in pyfuse3 trio outcome sniffio sortedcontainers attr attrs idna httpx httpcore h11 \
         certifi anyio cachetools yaml _yaml crc32c typing_extensions.py; do
  cp -a "$site"/$p* "$rt/site/"
done
cp "$(command -v fusermount3)" "$(command -v nginx)" "$rt/bin/"
[ -x "$venv/bin/py-spy" ] && cp "$venv/bin/py-spy" "$rt/bin/"   # static: --profile py-spy
# Every shared library they link but glibc's own.
find "$rt" -name '*.so*' -o -path "$rt/bin/*" -o -path "$rt/usr/bin/*" | while read -r f; do
  ldd "$f" 2>/dev/null | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*)\.so' | \
  while read -r lib; do cp -L "$lib" "$rt/lib/"; done
# Symbols are not needed there (libpython of a pyenv build: 23 MB with them, ~5 without).
if command -v strip >/dev/null; then strip --strip-unneeded "$rt"/lib/*.so* 2>/dev/null || true; fi

mkdir -p "$dir"
tar czf "$dir/rt.tgz" -C "$stage" rt
cp shardfs/fuse/_shim.cpython-*.so "$dir/"
ls -l "$dir"
