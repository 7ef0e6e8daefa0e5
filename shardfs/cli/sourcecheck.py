"""`shardfs doctor`'s checks of the shards' store: reachable, credentials, speed, sizes, indexes.

Bounded: every request has the doctor's own short timeout and deadline (not the mount's
minute), the speed sample reads at most SAMPLE_BYTES or SAMPLE_SECONDS of one shard, and
index files are looked for next to at most INDEX_SAMPLE shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import trio

from shardfs.catalog.catalog import CatalogError, stat_all
from shardfs.catalog.codecs import codec_for
from shardfs.catalog.resolve import resolve_sources
from shardfs.catalog.shardindex import INDEX_SUFFIX
from shardfs.cli.checks import Check
from shardfs.sources import NotFound, ShardInfo, SourceError, Sources, SourceSettings, Unreachable
from shardfs.sources.credentials import describe_method
from shardfs.sources.file import file_path
from shardfs.sources.http import renewal_advice, signatures_expire
from shardfs.util.sizes import format_duration, format_size, format_utc
from shardfs.util.urls import EXPIRES_SOON_S, beside

SAMPLE_BYTES = 32 << 20
SAMPLE_SECONDS = 5.0
INDEX_SAMPLE = 8
COMPRESSED = (".tar.gz", ".tgz", ".tar.zst", ".tar.lz4")
_UNREACHABLE_WORDS = ("unreachable", "cannot connect", "cannot resolve", "timed out",
                      "Name or service not known")
_CREDENTIAL_WORDS = ("signature does not match", "does not know", "access denied",
                     "session token", "credentials", "clock differs")


@dataclass(slots=True)
class SourceReport:
    checks: list[Check] = field(default_factory=list)
    largest: int | None = None  # bytes of the largest shard, when the shards were reached
    dataset_bytes: int | None = None
    fetched_bytes: int | None = None  # of those: the shards not read in place
    local_paths: list[str] = field(default_factory=list)  # of file:// shards (plain, tar)


def _cause(exc: Exception) -> tuple[str, str, str]:
    """(check name, what went wrong in a few words, fix) for a source error."""
    text = str(exc)
    if isinstance(exc, Unreachable) or any(word in text for word in _UNREACHABLE_WORDS):
        return ("sources", "unreachable", "check the URL's host and port, the network and "
                "any proxy; the store must answer from this machine")
    if isinstance(exc, NotFound) or "not found" in text or "no such" in text \
            or "no longer available" in text:
        return ("sources", "not found", "check the URL, brace pattern or bucket prefix")
    if any(word in text.lower() for word in _CREDENTIAL_WORDS):
        return ("credentials", "credentials rejected", "check which credentials are used "
                "(AWS_PROFILE, AWS_ACCESS_KEY_ID, the config's `credentials:`) and that they "
                "may read the bucket")
    return ("sources", "refused", "see the store's message above")


def _provider_check(sources: Sources) -> Check | None:
    providers = sources.stats().credential_providers
    if not providers:
        return None
    text = ", ".join(f"{kind}: {describe_method(m)}" for kind, m in providers.items())
    return Check("credential provider", "ok", text)


async def check_sources(specs: list[str], settings: SourceSettings, cache_size: int | None,
                        in_place: Callable[[str], bool] = lambda path: False) -> SourceReport:
    """`in_place`: whether the mount would read the plain local shard at a path in place
    (it then needs no room in the cache)."""
    report = SourceReport()
    sources = Sources(settings)
    try:
        await _check(specs, sources, cache_size, report, in_place)
    finally:
        with trio.CancelScope(shield=True):
            await sources.aclose()
    return report


async def _check(specs: list[str], sources: Sources, cache_size: int | None,
                 report: SourceReport, in_place: Callable[[str], bool]) -> None:
    checks = report.checks
    try:
        urls = await resolve_sources(specs, sources)
        infos = await stat_all(urls, sources)
    except (SourceError, CatalogError) as exc:
        name, cause, fix = _cause(exc)
        provider = _provider_check(sources)
        if provider is not None:
            checks.append(provider)
        checks.append(Check(name, "fail", f"{cause}: {exc}", fix))
        return
    provider = _provider_check(sources)
    if provider is not None:
        checks.append(provider)
    sizes = [info.size for info in infos]
    plain_local = {i: file_path(info.url) for i, info in enumerate(infos)
                   if info.url.startswith("file:") and codec_for(info.url) is None}
    report.local_paths = list(plain_local.values())
    report.largest = max(sizes, default=0)
    report.dataset_bytes = sum(sizes)
    hosts = sorted({urlsplit(url).netloc or "this machine" for url in urls})
    checks.append(Check("sources", "ok", f"{len(infos)} shards reachable on "
                        f"{', '.join(hosts)}, {format_size(report.dataset_bytes)} in all, "
                        f"largest {format_size(report.largest)}"))
    no_range = [info for info in infos if info.whole_only]
    if no_range:
        checks.append(Check("range requests", "slow", f"{len(no_range)} shards on a server that "
                            "ignores Range requests: every read waits for its shard's whole "
                            "download", "serve the shards from a server that honours Range"))
    signed = _signed_urls(infos, sources.settings)
    if signed is not None:
        checks.append(signed)
    checks.append(await _speed(sources, infos[sizes.index(report.largest)]))
    read_in_place = {i for i, path in plain_local.items() if in_place(path)}
    fetched = [info for i, info in enumerate(infos) if i not in read_in_place]
    report.fetched_bytes = sum(info.size for info in fetched)
    checks.extend(_sizes(fetched, cache_size, len(read_in_place)))
    checks.append(await _indexes(sources, infos))


def _signed_urls(infos: list[ShardInfo], settings: SourceSettings) -> Check | None:
    """When the shards' signed URLs expire (the earliest), if they say."""
    when = signatures_expire([info.url for info in infos], settings)
    if when is None:
        return None
    left = when - time.time()
    stamp, renew = format_utc(when), renewal_advice(settings)
    if left <= 0:
        return Check("signed URLs", "fail", f"the signature expired at {stamp}: the store "
                     "refuses every request", renew)
    if left < EXPIRES_SOON_S:
        return Check("signed URLs", "note", f"the signature expires at {stamp}, in "
                     f"{format_duration(left)}: reads fail from then on", renew + " before then")
    return Check("signed URLs", "ok", f"valid until {stamp} (in {format_duration(left)})")


async def _speed(sources: Sources, info: ShardInfo) -> Check:
    """Time to first byte and throughput of one shard's first bytes (bounded)."""
    end = min(info.size, SAMPLE_BYTES)
    start = time.monotonic()
    first: float | None = None
    got = 0
    try:
        with trio.move_on_after(SAMPLE_SECONDS):
            async for chunk in sources.for_url(info.url).stream(info, 0, end):
                if first is None:
                    first = time.monotonic() - start
                got += len(chunk)
    except SourceError as exc:
        name, cause, fix = _cause(exc)
        return Check(name, "fail", f"{cause}: reading {info.url}: {exc}", fix)
    seconds = time.monotonic() - start - (first or 0.0)
    if first is None:
        return Check("store speed", "slow", f"no byte of {info.url} within {SAMPLE_SECONDS:g} s",
                     "a store or link that answers faster")
    rate = got / seconds if seconds > 0 else float("inf")
    shown = "-" if rate == float("inf") else f"{format_size(int(rate))}/s"
    return Check("store speed", "ok", f"first byte after {1000 * first:.0f} ms, then {shown} "
                 f"({format_size(got)} of one shard, one connection; a mount runs up to 8)",
                 value=None if rate == float("inf") else rate)


def _sizes(infos: list[ShardInfo], cache_size: int | None, in_place: int) -> list[Check]:
    """`infos`: the shards that come into the cache; `in_place` more are read in place."""
    if cache_size is None:
        return []
    if not infos:
        return [Check("cache size", "ok", f"{format_size(cache_size)}; all {in_place} shards "
                      "are read in place and need no room in it")]
    largest = max(infos, key=lambda i: i.size)
    whole = [i for i in infos if i.whole_only or i.url.endswith(COMPRESSED)]
    if whole and max(i.size for i in whole) > cache_size:
        big = max(whole, key=lambda i: i.size)
        return [Check("cache size", "fail", f"cache size {format_size(cache_size)} is smaller "
                      f"than {big.url} ({format_size(big.size)}), which can only be read "
                      "whole: its reads fail with EIO",
                      "a --cache-size of several shards at least")]
    if largest.size > cache_size:
        return [Check("cache size", "slow", f"cache size {format_size(cache_size)} is smaller "
                      f"than the largest shard ({format_size(largest.size)}: {largest.url}): "
                      "such shards are never cached whole, every file is a request of its own",
                      "a --cache-size of several shards at least (8 fetch at once)")]
    shards = cache_size // max(1, largest.size)
    return [Check("cache size", "ok", f"{format_size(cache_size)}: room for {shards} of the "
                  "largest shards")]


async def _indexes(sources: Sources, infos: list[ShardInfo]) -> Check:
    sample = infos[:INDEX_SAMPLE]
    found = 0
    for info in sample:
        url = beside(info.url, INDEX_SUFFIX)
        try:
            with trio.move_on_after(SAMPLE_SECONDS):
                if await sources.for_url(url).fetch_optional(url) is not None:
                    found += 1
        except SourceError:
            pass
    if found == len(sample):
        return Check("index files", "ok", f"published next to the shards ({found} of "
                     f"{len(sample)} looked at)")
    return Check("index files", "note", f"{found} of {len(sample)} shards looked at have a "
                 f"published index ({INDEX_SUFFIX}): the first mount reads the others whole "
                 "to index them (later mounts use the local cache)",
                 "shardfs index SOURCE... -o DIR, and upload DIR's files next to the shards")
