"""Prometheus text endpoint (optional: needs `pip install shardfs[metrics]`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

# (metric name, snapshot path, kind, help)
_METRICS = (
    ("shardfs_uptime_seconds", ("uptime_s",), "gauge", "Seconds since the daemon started"),
    ("shardfs_shards", ("shards",), "gauge", "Shards in the mount"),
    ("shardfs_files", ("files",), "gauge", "Files in the mount"),
    ("shardfs_shards_cached", ("shards_cached",), "gauge", "Shards complete in the cache"),
    ("shardfs_shards_in_place", ("shards_in_place",), "gauge",
     "Of those, read from their own files (--in-place)"),
    ("shardfs_shards_fetching", ("shards_fetching",), "gauge", "Whole-shard fetches running"),
    ("shardfs_cache_used_bytes", ("cache_used_bytes",), "gauge", "Cache bytes in use"),
    ("shardfs_cache_budget_bytes", ("cache_budget_bytes",), "gauge", "Cache budget"),
    ("shardfs_cache_evictions", ("evictions",), "counter", "Shards evicted"),
    ("shardfs_fetched_bytes", ("bytes_fetched",), "counter", "Bytes fetched from sources"),
    ("shardfs_served_bytes", ("bytes_served",), "counter", "Bytes read through the mount"),
    ("shardfs_reads", ("reader", "reads"), "counter", "Read requests"),
    ("shardfs_cache_hits", ("reader", "cache_hits"), "counter", "Reads from complete shards"),
    ("shardfs_member_fetches", ("reader", "member_fetches"), "counter", "Member/block fetches"),
    ("shardfs_fetch_errors", ("reader", "fetch_errors"), "counter", "Failed fetches"),
    ("shardfs_eio", ("reader", "eio"), "counter", "Reads that failed with EIO"),
    ("shardfs_source_requests", ("source", "requests"), "counter", "Requests to sources"),
    ("shardfs_source_retries", ("source", "retries"), "counter", "Retried requests"),
    ("shardfs_workers", ("worker_count",), "gauge", "FUSE worker processes serving"),
    ("shardfs_worker_restarts", ("worker_restarts",), "counter", "Workers replaced"),
    ("shardfs_opens", ("opens",), "counter", "OPEN requests (one, with the shim)"),
    ("shardfs_ioctls", ("ioctls",), "counter",
     "IOCTL requests answered in C (Python's open() asks isatty() of each file)"),
    ("shardfs_fuse_requests_in_c", ("fuse_requests", "in_c"), "counter",
     "FUSE requests the shim's reader thread answered in C"),
    ("shardfs_fuse_requests_to_python", ("fuse_requests", "to_python"), "counter",
     "FUSE requests the shim's reader thread handed to pyfuse3"),
    ("shardfs_takeovers", ("takeovers",), "counter",
     "Daemons that took this mount over from a dead or replaced one"),
    ("shardfs_disk_reads_in_c", ("disk_reads", "in_c"), "counter",
     "Cache-file reads answered in C by the shim, from the page cache"),
    ("shardfs_disk_reads_inline", ("disk_reads", "inline"), "counter",
     "Cache-file reads served from the page cache without a thread"),
    ("shardfs_disk_reads_threaded", ("disk_reads", "threaded"), "counter",
     "Cache-file reads that went to a thread (would have waited for the disk)"),
    ("shardfs_early_member_reads", ("reader", "early_member_reads"), "counter",
     "Member reads instead of waiting on a slow whole-shard fetch"),
    ("shardfs_queued_member_reads", ("reader", "queued_member_reads"), "counter",
     "Of those, reads of shards queued for a download slot (most in the cold start)"),
    ("shardfs_member_hits", ("reader", "member_hits"), "counter",
     "Reads of a file whose member an earlier READ fetched or is fetching (no new bytes)"),
    ("shardfs_split_reads", ("reader", "split_reads"), "counter",
     "Reads that split a whole-shard fetch (their file by a GET of its own, fetched once)"),
    ("shardfs_resumed_bytes", ("reader", "resumed_bytes"), "counter",
     "Bytes of downloads an earlier daemon left unfinished, kept instead of fetched again"),
    ("shardfs_source_throttled", ("source", "throttled"), "counter",
     "Answers asking to slow down (429, 503 SlowDown)"),
    ("shardfs_source_budget_waits", ("source", "budget_waits"), "counter",
     "Requests that waited for the per-mount request budget"),
    ("shardfs_source_budget_wait_seconds", ("source", "budget_wait_s"), "counter",
     "Seconds requests waited for the request budget"),
    ("shardfs_source_credential_refreshes", ("source", "credential_refreshes"), "counter",
     "Temporary credentials obtained again"),
    ("shardfs_source_httpx_requests", ("source", "httpx_requests"), "counter",
     "Requests sent through httpx (a proxy, or an answer h1 leaves to it), not h1"),
    ("shardfs_source_spliced_bytes", ("source", "spliced_bytes"), "counter",
     "Bytes of downloads written from the socket into the cache by splice, not via Python"),
    ("shardfs_source_small_window_connections", ("source", "small_window_connections"),
     "counter", "Connections opened with a small receive window (cold start downloads)"),
    # What `shardfs top` shows (docs/tuning.md, "My training is slow: what to look at")
    ("shardfs_dataset_bytes", ("dataset_bytes",), "gauge", "Bytes of all shards (as cached)"),
    ("shardfs_working_set_bytes", ("working_set_bytes",), "gauge",
     "Bytes of the shards the recent reads touched"),
    ("shardfs_cache_evicted_bytes", ("evicted_bytes",), "counter", "Bytes evicted"),
    ("shardfs_frontier_hits", ("reader", "frontier_hits"), "counter",
     "Reads served from a shard being fetched, bytes already there"),
    ("shardfs_read_waits", ("reader", "waits"), "counter", "Reads that waited for a fetch"),
    ("shardfs_source_errors", ("source", "errors"), "counter", "Requests that failed"),
    ("shardfs_reads_in_flight", ("reads_in_flight",), "gauge",
     "Reads the daemon is answering now"),
    ("shardfs_oldest_read_seconds", ("oldest_read_s",), "gauge",
     "How long the oldest read in flight has waited"),
    ("shardfs_member_fetches_in_flight", ("member_fetches_in_flight",), "gauge",
     "Member/block GETs running"),
    ("shardfs_fetch_bytes_per_second", ("fetch_bps",), "gauge",
     "Bytes fetched per second over the last few seconds"),
    ("shardfs_link_peak_bytes_per_second", ("link_peak_bps",), "gauge",
     "The best fetch rate measured: the link's capacity as far as seen"),
    ("shardfs_daemon_cpu_seconds", ("cpu_s", "daemon"), "counter",
     "CPU seconds the daemon used"),
    ("shardfs_workers_cpu_seconds", ("cpu_s", "workers"), "counter",
     "CPU seconds the FUSE worker processes now serving used"),
    ("shardfs_lookahead_buffered_bytes", ("lookahead", "buffered_bytes"), "gauge",
     "Lookahead buffer in use (fetched and in-flight announced files)"),
    ("shardfs_lookahead_buffer_bytes", ("lookahead", "buffer_bytes"), "gauge",
     "Lookahead buffer size"),
    ("shardfs_shim", ("shim",), "gauge", "1 when the pyfuse3 shim is in effect"),
    ("shardfs_signed_urls_expiry_timestamp_seconds", ("signed_until",), "gauge",
     "When the signature of the shards' signed URLs expires (Unix time; absent without one)"),
)


def _lookup(snapshot: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = snapshot
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, int | float) else None


class _Collector:
    def __init__(self, latest: Callable[[], dict[str, Any]]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshot = self.latest()  # a finished dict swapped in by the daemon: safe to read here
        for name, path, kind, text in _METRICS:
            value = _lookup(snapshot, path)
            if value is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, text, value=value)


def start_metrics_server(listen: str, latest: Callable[[], dict[str, Any]]) -> None:
    """Serve /metrics from a background thread; the daemon refreshes `latest` every second."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry
    except ImportError:
        log.error("metrics_listen is set but prometheus-client is not installed "
                  "(pip install 'shardfs[metrics]'); no metrics served")
        return
    host, _, port = listen.rpartition(":")
    registry = CollectorRegistry()
    registry.register(_Collector(latest))
    try:
        start_http_server(int(port), addr=host, registry=registry)
    except OSError as exc:  # metrics are an add-on: report, keep serving files
        log.error("cannot serve metrics on %s: %s", listen, exc.strerror)
        return
    log.info("Prometheus metrics on http://%s/metrics", listen)
