#!/usr/bin/env bash
# The node scenario on a many-core machine (issue 26): `bench node` at P=8 and P=16 readers
# with --workers 1, 4 and 8, then `bench cpusplit` (where a cold file's CPU goes, per process
# and thread) at P=16 with 1 and 4 workers, lingering and the C push on and off in turns, and
# for shards read in place (`bench node` has that phase too). About 7 minutes on 16 cores.
#
#   bench/device_node.sh OUTDIR
#
# Run from the repository root as root (mounts, drop_caches), with shardfs's dependencies
# importable by $PYTHON (default python3; VENV=/path/to/venv activates one first) and the shim
# built in place (python3 setup.py build_ext --inplace).
# Results: OUTDIR/node-w{1,4,8}.log, OUTDIR/cpusplit.log, OUTDIR/cpusplit-in-place.log, OUTDIR/machine.txt, and the JSON
# records under OUTDIR/raw/. FILES=N changes the file count (default 20000).
# The HTTP phases need nginx; without it they are left out (file:// only).
set -u
out=${1:?usage: bench/device_node.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ -n "${VENV:-}" ]; then . "$VENV/bin/activate"; fi
PYTHON=${PYTHON:-python3}
files=${FILES:-20000}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d /tmp/shardfs-device-XXXXXX)
trap 'rm -rf "$work"' EXIT

{
  date -u; uname -a; nproc; free -g; $PYTHON --version
  $PYTHON -c "import shardfs.fuse.shim as s; print(s.__file__, 'shim loaded:', s._lib is not None)"
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
  timeout 150 $PYTHON -c "$node_main" --readers 8,16 --workers "$w" --files "$files" \
    --workdir "$work" --out "$out/raw" "${node_extra[@]}" > "$out/node-w$w.log" 2>&1
  echo "bench node workers=$w: exit $?" >> "$out/machine.txt"
done
# Where the CPU goes, and the changes of issue 26 on and off in turns: the shim's lingering
# (off by default; SHARDFS_LINGER_US=300: on) and the page push's loop in C
# (SHARDFS_PUSH_IN_PYTHON=1: the Python loop).
timeout 150 $PYTHON -m bench.cpusplit --readers 16 --workers 1,4 --sources file --rounds 2 \
  --files "$files" --variant this=$PWD --variant linger300=$PWD:SHARDFS_LINGER_US=300 \
  --variant pypush=$PWD:SHARDFS_PUSH_IN_PYTHON=1 --workdir "$work" --out "$out/raw" \
  > "$out/cpusplit.log" 2>&1
echo "bench cpusplit: exit $?" >> "$out/machine.txt"
# Shards read in place (--in-place on): no copy, no push; the serial part on many cores.
timeout 100 $PYTHON -m bench.cpusplit --readers 16 --workers 1,4 --sources in-place \
  --rounds 2 --files "$files" --workdir "$work" --out "$out/raw" > "$out/cpusplit-in-place.log" 2>&1
echo "bench cpusplit in place: exit $?" >> "$out/machine.txt"
ls "$out/raw" >> "$out/machine.txt" 2>&1
