"""The loaders of the `s3` scenario's peers, for bench/epoch.py: litdata, MosaicML Streaming and
Ray Data, each built the way its docs recommend, yielding batches bench/epoch.py counts (a 1-D
tensor of sample lengths, and labels).

Each is imported only here, in the epoch process, so the harness runs without them.
"""

from __future__ import annotations

import os

PEER_KINDS = ("litdata", "mosaic", "ray")


def lengths_collate(items: list) -> tuple:
    """Samples (dicts with the image bytes) -> (lengths tensor, labels tensor). Raw bytes
    epochs: every byte was read, only lengths cross to the loop (as bench/epoch.py does)."""
    import torch

    lens = [len(_image(it)) for it in items]
    labels = [int(it.get("label", 0)) if isinstance(it, dict) else 0 for it in items]
    return torch.tensor(lens), torch.tensor(labels)


def _image(item) -> bytes:
    if isinstance(item, dict):
        return item["image"]
    return item[0]


def import_peer(kind: str) -> None:
    """Imported before the clock starts, like a training script's imports."""
    if kind == "litdata":
        import litdata  # noqa: F401
    elif kind == "mosaic":
        import streaming  # noqa: F401
    elif kind == "ray":
        import ray
        import ray.data  # noqa: F401


def build(spec: dict):
    kind = spec["kind"]
    if kind == "litdata":
        return _litdata(spec)
    if kind == "mosaic":
        return _mosaic(spec)
    if kind == "ray":
        return _ray(spec)
    raise ValueError(f"unknown peer kind {kind!r}")


def _litdata(spec: dict):
    # https://github.com/Lightning-AI/litData#stream-datasets (StreamingDataset +
    # StreamingDataLoader; storage_options for a custom S3 endpoint and keys).
    import litdata as ld
    from litdata.streaming import downloader

    # litdata fetches chunks with obstore, which refuses http:// endpoints unless its client
    # options allow it (obstore's ClientConfig `allow_http`); litdata has no setting for it.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    ds = ld.StreamingDataset(spec["input_dir"], storage_options=spec["storage_options"],
                             shuffle=True, seed=spec.get("seed", 0),
                             cache_dir=spec["cache_dir"],
                             max_cache_size=spec.get("max_cache_size", "100GB"))
    loader = ld.StreamingDataLoader(ds, batch_size=spec["batch_size"],
                                    num_workers=spec["workers"],
                                    collate_fn=lengths_collate)
    return ds, loader


def _mosaic(spec: dict):
    # https://docs.mosaicml.com/projects/streaming/en/stable/getting_started/quick_start.html
    # (StreamingDataset(remote=, local=, shuffle=, batch_size=) + a torch DataLoader) and
    # .../how_to_guides/configure_cloud_storage_credentials.html (S3_ENDPOINT_URL, AWS keys).
    import streaming
    from torch.utils.data import DataLoader

    streaming.base.util.clean_stale_shared_memory()
    ds = streaming.StreamingDataset(remote=spec["remote"], local=spec["local"], shuffle=True,
                                    shuffle_seed=spec.get("seed", 0),
                                    batch_size=spec["batch_size"],
                                    cache_limit=spec.get("cache_limit"))
    _forget_s3_clients(ds)
    loader = DataLoader(ds, batch_size=spec["batch_size"], num_workers=spec["workers"],
                        collate_fn=lengths_collate, persistent_workers=False)
    return ds, loader


def _forget_s3_clients(ds) -> None:
    """Streaming downloads index.json in this process at construction and keeps that boto3
    client in each stream's downloader; forked DataLoader workers would share its kept-alive
    socket (reads then stall or mix). Drop it (`clean_up()`), so each worker makes its own."""
    for stream in getattr(ds, "streams", []):
        downloader = getattr(stream, "_downloader", None)
        if downloader is not None:
            downloader.clean_up()


def _ray(spec: dict):
    # https://docs.ray.io/en/latest/data/loading-data.html#reading-files (read_binary_files
    # with a pyarrow S3FileSystem for a custom endpoint) and
    # https://docs.ray.io/en/latest/data/iterating-over-data.html (iter_torch_batches; a
    # local shuffle buffer, as their docs advise over a global random_shuffle per epoch).
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=spec["workers"], include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    fs = None
    if spec.get("s3"):
        from pyarrow import fs as pafs

        s3 = spec["s3"]
        fs = pafs.S3FileSystem(access_key=s3["key"], secret_key=s3["secret"],
                               endpoint_override=s3["endpoint"], scheme="http",
                               region="us-east-1")
    ds = ray.data.read_binary_files(spec["paths"], filesystem=fs, include_paths=False,
                                    shuffle="files")
    return None, _RayBatches(ds, spec["batch_size"], spec.get("shuffle_buffer", 1000))


class _RayBatches:
    def __init__(self, ds, batch_size: int, buffer: int) -> None:
        self.ds, self.batch_size, self.buffer = ds, batch_size, buffer
        self.cpu0 = session_cpu_seconds()

    def finish(self) -> float:
        """CPU of Ray's processes and ours since construction; then stop Ray (its processes
        would outlive the epoch otherwise)."""
        import ray

        cpu = session_cpu_seconds() - self.cpu0
        ray.shutdown()
        return cpu

    def __iter__(self):
        import torch

        for batch in self.ds.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                          local_shuffle_buffer_size=self.buffer):
            data = batch["bytes"]
            yield torch.tensor([len(b) for b in data]), torch.zeros(len(data), dtype=torch.long)


def session_cpu_seconds() -> float:
    """CPU of every live process in this process's session (Ray's raylet, GCS and workers
    are not our waited-for children, so wait4 would miss them)."""
    from bench.procs import cpu_seconds

    sid = os.getsid(0)
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
        except OSError:
            continue
        total += cpu_seconds(int(entry)) or 0.0
    return total
