#!/usr/bin/env bash
# The node scenario on a many-core machine (issue 26): `bench node` at P=8 and P=16 readers
# with --workers 1, 4 and 8 (the readers' tree listed first, as ImageFolder does), then
# `bench cpusplit` (where a cold file's CPU goes, per process and thread) at P=16 with 1 and
# 4 workers on the machine's disk, and with 1 and 8 workers, two rounds, with source and
# cache held in memory (/dev/shm: the CPU, not the disk, sets the pace), for HTTP, copied
# file:// and shards read in place. About 6 minutes on 16 cores, from its parts' times in
# session 31 (not run whole there: the parts ran as separate calls).
#
#   bench/device_node.sh OUTDIR
#
# Run from the repository root as root (mounts, drop_caches). With the runtime that
# bench/device_runtime.sh packs (RUNTIME, default .dev: RUNTIME/rt.tgz and the shim built
# here), that runtime is unpacked into /tmp/rt and used; else shardfs's dependencies must be
# importable by $PYTHON (default python3; VENV=/path/to/venv activates one first) and the
# shim built in place (python3 setup.py build_ext --inplace).
# Results: OUTDIR/node-w{1,4,8}.log, OUTDIR/cpusplit.log, OUTDIR/cpusplit-shm.log,
# OUTDIR/machine.txt, and the JSON records under OUTDIR/raw/. FILES=N changes the file count
# (default 60000).
# The HTTP phases need nginx; without it they are left out (file:// only).
set -u
out=${1:?usage: bench/device_node.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
runtime=${RUNTIME:-.dev}
if [ -f "$runtime/rt.tgz" ]; then
  rm -rf /tmp/rt && tar xzf "$runtime/rt.tgz" -C /tmp
  export PYTHONHOME=/tmp/rt/usr PATH=/tmp/rt/bin:/tmp/rt/usr/bin:$PATH
  export PYTHONPATH=/tmp/rt/site LD_LIBRARY_PATH=/tmp/rt/lib PYTHONNOUSERSITE=1
  cp "$runtime"/_shim.cpython-*.so shardfs/fuse/
fi
if [ -n "${VENV:-}" ]; then . "$VENV/bin/activate"; fi
[ -e /dev/fuse ] || mknod /dev/fuse c 10 229
PYTHON=${PYTHON:-python3}
files=${FILES:-60000}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d /tmp/shardfs-device-XXXXXX)
trap 'rm -rf "$work"' EXIT

{
  date -u; uname -a; nproc; free -g; $PYTHON --version
  $PYTHON -c "import shardfs.fuse.shim as s; print(s.__file__, 'shim loaded:', s.loaded())"
  command -v nginx >/dev/null && echo "nginx: yes" || echo "nginx: no (file:// only)"
} > "$out/machine.txt" 2>&1

node_extra=()
if ! command -v nginx >/dev/null; then
  node_extra=(--no-http)
fi

node_main='import argparse, sys
from bench.node import add_arguments, node_command
p = argparse.ArgumentParser(prog="bench node")
add_arguments(p)
sys.exit(node_command(p.parse_args(sys.argv[1:]), sys.argv[1:]))'

for w in 1 4 8; do
  # bench.node directly: `python -m bench` imports every contender's module
  timeout 150 $PYTHON -c "$node_main" --readers 8,16 --workers "$w" --list --files "$files" \
    --workdir "$work" --out "$out/raw" "${node_extra[@]}" > "$out/node-w$w.log" 2>&1
  echo "bench node workers=$w: exit $?" >> "$out/machine.txt"
done
sources=file,in-place
if command -v nginx >/dev/null; then sources=http,$sources; fi
timeout 120 $PYTHON -m bench.cpusplit --readers 16 --workers 1,4 --sources "$sources" --list \
  --rounds 1 --files "$files" --workdir "$work" --out "$out/raw" > "$out/cpusplit.log" 2>&1
echo "bench cpusplit: exit $?" >> "$out/machine.txt"
# Source and cache in memory: the mount's CPU ceiling on this many cores.
shm=$(mktemp -d /dev/shm/shardfs-device-XXXXXX)
timeout 150 $PYTHON -m bench.cpusplit --readers 16 --workers 1,8 --sources "$sources" --list \
  --rounds 2 --files "$files" --workdir "$shm" --out "$out/raw" > "$out/cpusplit-shm.log" 2>&1
echo "bench cpusplit in memory: exit $?" >> "$out/machine.txt"
rm -rf "$shm"
ls "$out/raw" >> "$out/machine.txt" 2>&1
