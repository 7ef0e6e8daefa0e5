"""The peers' own formats, written once from the bench's ImageFolder (and timed): litdata's
`optimize()` chunks and MosaicML Streaming's MDS shards, with the tar shards' target size.

Kept under the data dir next to the dataset (a marker records the parameters and the time the
conversion took), so a second run reuses them; a peer that is not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from bench.data import Dataset

MARKER = "converted.json"


def samples(data: Dataset) -> list[tuple[str, int]]:
    """(path, class index) for every image, in ImageFolder's order."""
    root = data.loose.resolve() / "train"  # litdata.optimize mishandles relative paths
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(str(f), i) for i, c in enumerate(classes) for f in sorted((root / c).iterdir())]


def read_sample(item: tuple[str, int]) -> dict:
    """litdata's `optimize` fn: the raw JPEG bytes and the label (no decode, as the tar)."""
    path, label = item
    with open(path, "rb") as f:
        return {"image": f.read(), "label": label}


def _cached(out: Path, want: dict) -> dict | None:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return marker if marker.get("params") == want else None


def to_litdata(data: Dataset, base: Path, say: Callable[[str], None]) -> dict | None:
    if importlib.util.find_spec("litdata") is None:
        return None
    out = base.resolve() / f"litdata-{data.params.key()}"  # optimize() needs it absolute
    want = {"format": 1, "dataset": data.params.key()}
    marker = _cached(out, want)
    if marker is not None:
        return {"dir": str(out / "data"), **marker}
    import litdata

    shutil.rmtree(out, ignore_errors=True)
    say("litdata: optimize() ...")
    t = time.monotonic()
    litdata.optimize(fn=read_sample, inputs=samples(data), output_dir=str(out / "data"),
                     chunk_bytes=int(data.params.shard_mb * 2**20), num_workers=1,
                     mode="overwrite")
    took = time.monotonic() - t
    nbytes = sum(p.stat().st_size for p in (out / "data").rglob("*") if p.is_file())
    if nbytes < data.loose_bytes:
        raise RuntimeError(f"litdata.optimize wrote {nbytes} bytes for {data.loose_bytes}")
    marker = {"params": want, "s": round(took, 3), "bytes": nbytes,
              "files": sum(1 for p in (out / "data").rglob("*") if p.is_file())}
    (out / MARKER).write_text(json.dumps(marker))
    say(f"litdata: {marker['files']} files, {nbytes / 1e6:.1f} MB in {took:.1f} s")
    return {"dir": str(out / "data"), **marker}


def to_mds(data: Dataset, base: Path, say: Callable[[str], None]) -> dict | None:
    if importlib.util.find_spec("streaming") is None:
        return None
    out = base.resolve() / f"mds-{data.params.key()}"
    want = {"format": 1, "dataset": data.params.key()}
    marker = _cached(out, want)
    if marker is not None:
        return {"dir": str(out / "data"), **marker}
    from streaming import MDSWriter

    shutil.rmtree(out, ignore_errors=True)
    say("MosaicML Streaming: MDSWriter ...")
    t = time.monotonic()
    with MDSWriter(out=str(out / "data"), columns={"image": "bytes", "label": "int"},
                   size_limit=int(data.params.shard_mb * 2**20)) as w:
        for item in samples(data):
            w.write(read_sample(item))
    took = time.monotonic() - t
    nbytes = sum(p.stat().st_size for p in (out / "data").rglob("*") if p.is_file())
    marker = {"params": want, "s": round(took, 3), "bytes": nbytes,
              "files": sum(1 for p in (out / "data").rglob("*") if p.is_file())}
    (out / MARKER).write_text(json.dumps(marker))
    say(f"MDS: {marker['files']} files, {nbytes / 1e6:.1f} MB in {took:.1f} s")
    return {"dir": str(out / "data"), **marker}
