"""One epoch of the benchmark loop, run in its own process: `python -m bench.epoch SPEC_JSON`.

The same loop for every contender: a map-style dataset (ImageFolder over a directory, or wids
over shards) or webdataset streaming, a DataLoader with `shuffle=True` (map-style), every file
read fully. `decode` switches the raw-bytes loader for torchvision's default PIL loader plus
Resize/CenterCrop. Prints progress to stderr and one JSON line (prefixed RESULT) to stdout.

Running each epoch in a child process isolates hangs (a stuck FUSE read is killed with its
process group by the harness) and gives the client-side CPU time via wait4's rusage.
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULT_PREFIX = "RESULT "
PEER_KINDS = ("litdata", "mosaic", "ray")  # bench/peer_epoch.py
T0 = time.monotonic()


def _say(text: str) -> None:
    print(f"    [epoch +{time.monotonic() - T0:6.1f}s] {text}", file=sys.stderr, flush=True)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def nbytes_loader(path: str) -> int:
    """Read the whole file; the sample is its length (so batches stay tiny)."""
    return len(read_bytes(path))


def decode_transform():
    from torchvision import transforms

    return transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                               transforms.PILToTensor()])


class _WidsSample:
    """wids sample -> (payload length or decoded tensor, 0)."""

    def __init__(self, decode: bool) -> None:
        self.decode = decode
        self.tf = decode_transform() if decode else None

    def __call__(self, sample: dict):
        data = next(v for k, v in sample.items() if not k.startswith("__"))
        if hasattr(data, "read"):  # wids hands out stream objects in some versions
            data = data.read()
        return _payload(bytes(data), self.tf), 0


def _payload(data: bytes, tf):
    if tf is None:
        return len(data)
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return tf(img.convert("RGB"))


def _wds_sample(tf):
    def f(sample: dict):
        data = next(v for k, v in sample.items() if not k.startswith("__"))
        return _payload(data, tf), 0
    return f


def _count(batch) -> tuple[int, int]:
    """(files, bytes) in a batch: raw batches carry lengths, decoded ones tensors."""
    import torch

    x = batch[0]
    n = len(x)
    if isinstance(x, torch.Tensor) and x.dim() == 1:
        return n, int(x.sum())
    return n, 0


class _Indexed:
    """A folder dataset whose samples are (file length, index): batches say which indices the
    loader read (the resume scenario checks them). `samples` stays for the samplers."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.samples = folder.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return nbytes_loader(self.samples[i][0]), i


def _sampler(name: str, ds, g, spec: dict):
    """The sampler a folder epoch uses (None: the loader's own shuffle=True)."""
    if name == "shard-aware":
        from shardfs.torch import ShardAwareSampler

        return ShardAwareSampler(ds, shuffle=True, seed=spec.get("seed", 0),
                                 map_cache=spec.get("map_cache", True))
    if name == "lookahead":  # the stock order (same generator), announced ahead
        from torch.utils.data import RandomSampler

        from shardfs.torch import Lookahead

        return Lookahead(RandomSampler(ds, generator=g))
    return None


def build(spec: dict):
    import torch
    from torch.utils.data import DataLoader

    kind, decode = spec["kind"], spec.get("decode", False)
    if kind in PEER_KINDS:  # litdata, MosaicML Streaming, Ray Data (the `s3` scenario)
        from bench.peer_epoch import build as build_peer

        return build_peer(spec)
    workers, batch = spec["workers"], spec["batch_size"]
    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    common = dict(batch_size=batch, num_workers=workers, persistent_workers=False,
                  prefetch_factor=spec.get("prefetch_factor", 2) if workers else None)
    if kind == "folder":
        from torchvision import datasets

        if decode:
            ds = datasets.ImageFolder(spec["root"], transform=decode_transform())
        else:
            ds = datasets.ImageFolder(spec["root"], loader=nbytes_loader)
        if spec.get("resume"):  # torchdata's StatefulDataLoader, batches of indices
            from torchdata.stateful_dataloader import StatefulDataLoader

            ds = _Indexed(ds)
            sampler = _sampler(spec.get("sampler", "random"), ds, g, spec)
            if sampler is None:
                return ds, StatefulDataLoader(ds, shuffle=True, generator=g, **common)
            return ds, StatefulDataLoader(ds, sampler=sampler, **common)
        sampler = _sampler(spec.get("sampler", "random"), ds, g, spec)
        if sampler is not None:
            return ds, DataLoader(ds, sampler=sampler, **common)
        return ds, DataLoader(ds, shuffle=True, generator=g, **common)
    if kind == "wids":
        import wids

        ds = wids.ShardListDataset(spec["index"], cache_dir=spec["cache_dir"],
                                   transformations=[_WidsSample(decode)])
        return ds, DataLoader(ds, shuffle=True, generator=g, **common)
    if kind == "webdataset":
        import webdataset as wds

        tf = decode_transform() if decode else None
        ds = (wds.WebDataset(spec["urls"], shardshuffle=len(spec["urls"]),
                             workersplitter=wds.split_by_worker, nodesplitter=None,
                             empty_check=False, seed=spec.get("seed", 0))
              .shuffle(spec.get("shuffle_buffer", 1000))
              .map(_wds_sample(tf)))
        return ds, DataLoader(ds, **common)
    raise ValueError(f"unknown kind {kind!r}")


def _expected_order(spec: dict, ds) -> list[int]:
    """The uninterrupted epoch's order of a resumed epoch: the wrapped sampler's order of a
    fresh sampler; for shuffle=True, a fresh StatefulDataLoader's (its RandomSampler shares
    the generator with the loader's own seeds), over the indices alone (no file is read)."""
    import torch

    g = torch.Generator()
    g.manual_seed(spec.get("seed", 0))
    sampler = _sampler(spec.get("sampler", "random"), ds, g, spec)
    if sampler is not None:
        return [int(i) for i in getattr(sampler, "sampler", sampler)]
    from torchdata.stateful_dataloader import StatefulDataLoader

    workers = spec["workers"]
    loader = StatefulDataLoader(list(range(len(ds))), shuffle=True, generator=g,
                                batch_size=spec["batch_size"], num_workers=workers,
                                prefetch_factor=spec.get("prefetch_factor", 2) if workers
                                else None)
    return [int(i) for batch in loader for i in batch]


def _cpu_s() -> float:
    """CPU of this process and its reaped children (DataLoader workers, once joined)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run(spec: dict) -> dict:
    began = time.monotonic()
    ds, loader = build(spec)
    built = time.monotonic()
    cpu_built = _cpu_s()
    try:
        length = len(ds)
    except TypeError:
        length = None
    _say(f"dataset ready in {built - began:.2f} s ({length} samples); iterating")
    files = nbytes = 0
    first = None
    last_say = built
    # (seconds since the dataset was built, files so far) after each batch: how much of the
    # epoch was read while bytes were still arriving (docs/benchmarks-notes.md, "Arrived shards
    # pushed into the page cache").
    timeline: list[tuple[float, int]] = []
    deadline = spec.get("limit_s")
    timed_out = False
    resume = spec.get("resume")  # {"phase": "first"|"rest", "state": path, "stop_after": n}
    indices: list[int] = []
    if resume and resume["phase"] == "rest":
        import torch

        loader.load_state_dict(torch.load(resume["state"], weights_only=False)["loader"])
    for batch in loader:
        now = time.monotonic()
        if first is None:
            first = now
        n, b = _count(batch)
        files += n
        nbytes += b
        timeline.append((round(now - built, 4), files))
        if resume:
            indices += batch[1].tolist()
            if resume["phase"] == "first" and len(timeline) == resume["stop_after"]:
                break
        if now - last_say >= spec.get("progress_s", 5.0):
            last_say = now
            _say(f"{files} files, {nbytes / 1e6:.1f} MB, {files / (now - built):.0f} files/s")
        if deadline and now - began > deadline:
            timed_out = True
            break
    end = time.monotonic()
    resumed = _resume_end(resume, loader, ds, indices, spec) if resume else {}

    # Loaders whose processes are not our children (Ray) measure them and stop them here.
    own_cpu = loader.finish() if hasattr(loader, "finish") else None
    del loader  # joins the DataLoader workers, so that their CPU is counted below
    iterate_cpu = _cpu_s() - cpu_built
    return {
        **resumed,
        "files": files,
        "bytes": nbytes,
        "dataset_len": length,
        "construct_s": built - began,
        "ttfb_s": (first - began) if first is not None else None,
        "iterate_s": end - built,
        "iterate_cpu_s": round(iterate_cpu if own_cpu is None else own_cpu, 3),  # loader CPU
        # of the iteration alone
        "total_s": end - began,
        "timed_out": timed_out,
        "startup_s": began - T0,  # interpreter + torch import before the clock started
        "timeline": timeline,
        "iterate_start_mono": built,  # time.monotonic(): lines up with samplers beside the run
    }


def _resume_end(resume: dict, loader, ds, indices: list[int], spec: dict) -> dict:
    """After the first half: the loader's state (and the indices read) saved for the second.
    After the second: whether the halves make the uninterrupted epoch, each index once."""
    import torch

    if resume["phase"] == "first":
        torch.save({"loader": loader.state_dict(), "indices": indices}, resume["state"])
        return {"resume_indices": len(indices)}
    before = torch.load(resume["state"], weights_only=False)["indices"]
    expected = _expected_order(spec, ds)
    return {"resume_indices": len(indices), "resume_before": len(before),
            "resume_union_ok": before + indices == expected,
            "resume_each_once": sorted(before + indices) == list(range(len(ds)))}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("kind") == "meta":
        print(RESULT_PREFIX + json.dumps(meta(spec)), flush=True)
        return
    import warnings

    # Imported before the clock starts, like any training script does at its top.
    import torch  # noqa: F401
    import torchvision.datasets  # noqa: F401

    if spec["kind"] == "wids":
        import wids  # noqa: F401
    elif spec["kind"] == "webdataset":
        import webdataset  # noqa: F401
    elif spec["kind"] in PEER_KINDS:
        from bench.peer_epoch import import_peer

        import_peer(spec["kind"])
    # More workers than cores is deliberate here (I/O-bound loaders): silence that warning.
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    global T0
    T0 = time.monotonic()
    result = run(spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    os._exit(0)  # skip interpreter teardown (DataLoader workers are already joined)


def meta(spec: dict) -> dict:
    """Metadata only: `find ROOT` (count entries), then ImageFolder(ROOT/train) construction."""
    import subprocess

    root = spec["root"]
    out: dict = {}
    t = time.monotonic()
    try:
        proc = subprocess.run(["find", root], capture_output=True, check=False,
                              timeout=spec.get("limit_s"))
    except subprocess.TimeoutExpired as exc:
        out["find_s"] = time.monotonic() - t
        out["find_entries"] = (exc.stdout or b"").count(b"\n")
        out["timed_out"] = True
        return out
    out["find_s"] = time.monotonic() - t
    out["find_entries"] = proc.stdout.count(b"\n")
    out["find_rc"] = proc.returncode
    from torchvision import datasets

    t = time.monotonic()
    ds = datasets.ImageFolder(os.path.join(root, "train"), loader=nbytes_loader)
    out["imagefolder_s"] = time.monotonic() - t
    out["imagefolder_files"] = len(ds)
    out["classes"] = len(ds.classes)
    return out


if __name__ == "__main__":
    main()
