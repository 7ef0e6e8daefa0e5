"""From the SOURCE arguments the user typed to the ordered list of shard URLs to mount.

    urls = await resolve_sources(["s3://b/train/", "list.txt", "data/x-{0..9}.tar"], sources)

Each SOURCE is brace-expanded (WebDataset style); every resulting name is turned into a URL
(plain paths become file:// URLs) and then, in order:

- a name whose path ends in `.txt` or `.json` is a **manifest**: fetched (any scheme) and
  replaced by the shard URLs it lists: a text file with one URL or path per line (`#`
  comments and blank lines skipped), or a wids shard index (JSON, `{"__kind__":
  "wids-shard-index-v1", "shardlist": [{"url": ...}, ...]}`; also plain wids dataset
  descriptions with `"datasets"`). Relative entries are resolved against the manifest's own
  location (a wids `"base"`, itself relative to the manifest, takes its place). In a local
  manifest, entries without a scheme are file paths, not URL references.
- an `s3://`, `ais://` or `gs://` name ending in `/`, naming a whole bucket, or — when the
  SOURCE had no braces — not ending in a shard suffix is a **prefix**: replaced by the objects
  directly under it (ListObjectsV2 with delimiter `/`, all pages) whose keys end in a shard
  suffix, sorted. A local directory (same rule) is listed the same way. (`hf://` names are
  not listed: name the files, e.g. with braces.)
- anything else is a shard URL, kept as is (it is stat-ed later, by the catalog).

Order is kept: SOURCE order, then the order inside each SOURCE (brace order, manifest order,
sorted listings). Duplicates are kept. Errors are SourceError subclasses: ResolveError for a
bad pattern, an unreadable manifest or a manifest/prefix/directory with no shards; NotFound,
Unreachable etc. from fetching a manifest or listing a prefix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import trio

from shardfs.catalog.patterns import PatternError, expand_braces
from shardfs.catalog.shardindex import INDEX_SUFFIX
from shardfs.sources import NotFound, SourceError, Sources, to_url
from shardfs.sources.file import file_path
from shardfs.sources.s3 import split_bucket_url
from shardfs.util.urls import replace_suffix

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.lz4", ".zip", ".rec")
RECORDIO_INDEX_SUFFIX = ".idx"  # `x.idx` beside `x.rec`: read with it, not a shard
MANIFEST_SUFFIXES = (".txt", ".json")
WIDS_KIND = "wids-shard-index-v1"
BUCKET_SCHEMES = ("s3", "ais", "gs")
MAX_MANIFEST_DEPTH = 1  # a wids "datasets" entry may name one more description, no further


class ResolveError(SourceError):
    """A SOURCE that names no shards: bad pattern, unreadable manifest, empty listing."""


async def resolve_sources(specs: list[str], sources: Sources) -> list[str]:
    """The shard URLs named by `specs`, in order (see the module docstring)."""
    urls: list[str] = []
    named = [(spec, name) for spec in specs for name in _expand(spec)]
    listed = {to_url(name) for _, name in named}
    for spec, name in named:
        url = to_url(name)
        if _name_path(url).endswith(INDEX_SUFFIX):
            # `mount shards/*` names the published index files too: they are found next to
            # their shards anyway. One on its own is a mistake worth naming.
            shard = replace_suffix(url, INDEX_SUFFIX, "") or url
            if shard in listed:
                continue
            raise ResolveError(f"{spec}: {url} is a shardfs index file, not a shard; name the "
                               f"shard ({shard}) and its index is used from next to it")
        rec = replace_suffix(url, RECORDIO_INDEX_SUFFIX, ".rec") \
            if _name_path(url).endswith(RECORDIO_INDEX_SUFFIX) else None
        if rec is not None and rec in listed:
            continue  # `mount data/*` names train.idx beside train.rec: it goes with it
        if rec is not None:
            raise ResolveError(f"{spec}: {url} looks like the index of a RecordIO file; name "
                               f"the .rec ({rec}) and its .idx is used from beside it")
        urls.extend(await _resolve_name(spec, url, "{" in spec, sources))
    if not urls:
        raise ResolveError("no shards: the SOURCE arguments name nothing")
    return urls


def _expand(spec: str) -> list[str]:
    try:
        return expand_braces(spec)
    except PatternError as e:
        raise ResolveError(str(e)) from None


def _scheme(url: str) -> str:
    return urlsplit(url).scheme.lower()


def _name_path(url: str) -> str:
    """The part of the URL that names the object (for suffix tests)."""
    if _scheme(url) in BUCKET_SCHEMES:
        return split_bucket_url(url, _scheme(url))[1]
    return urlsplit(url).path


def is_manifest(url: str) -> bool:
    return _name_path(url).lower().endswith(MANIFEST_SUFFIXES)


def is_shard_name(name: str) -> bool:
    return name.lower().endswith(SHARD_SUFFIXES)


async def _resolve_name(spec: str, url: str, braced: bool, sources: Sources) -> list[str]:
    if is_manifest(url):
        found = await _manifest(url, sources, 0)
        if not found:
            raise ResolveError(f"{spec}: the manifest {url} lists no shards")
        return found
    scheme = _scheme(url)
    if scheme in BUCKET_SCHEMES:
        key = split_bucket_url(url, scheme)[1]
        if key == "" or key.endswith("/") or (not braced and not is_shard_name(key)):
            return await _list_bucket(spec, url, sources)
    elif scheme == "file" and not braced and not is_shard_name(url):
        path = file_path(url)
        if await trio.to_thread.run_sync(os.path.isdir, path):
            return await _list_directory(spec, path)
    return [url]


# -- listings ----------------------------------------------------------------------------------


async def _list_bucket(spec: str, url: str, sources: Sources) -> list[str]:
    source = sources.for_url(url)
    listing = await source.list_prefix(url)  # type: ignore[attr-defined]
    shards = sorted(u for u in listing.urls if is_shard_name(u))
    if not shards:
        extra = ""
        if listing.prefixes:
            shown = ", ".join(listing.prefixes[:5]) + (", ..." if len(listing.prefixes) > 5 else "")
            extra = f"; sub-prefixes (not searched): {shown}"
        raise ResolveError(
            f"{spec}: no shards under {url}: {len(listing.urls)} objects, none ending in "
            f"{'/'.join(SHARD_SUFFIXES)}{extra}")
    return shards


def _scan_directory(path: str) -> tuple[list[str], int]:
    names, others = [], 0
    with os.scandir(path) as entries:
        for entry in entries:
            if is_shard_name(entry.name) and entry.is_file():
                names.append(entry.name)
            else:
                others += 1
    return sorted(names), others


async def _list_directory(spec: str, path: str) -> list[str]:
    try:
        names, others = await trio.to_thread.run_sync(_scan_directory, path)
    except OSError as e:
        raise SourceError(f"{spec}: cannot list directory {path}: {e.strerror}") from None
    if not names:
        raise ResolveError(f"{spec}: no shards in directory {path}: {others} entries, none a "
                           f"file ending in {'/'.join(SHARD_SUFFIXES)}")
    return [Path(path, name).as_uri() for name in names]


# -- manifests ---------------------------------------------------------------------------------


async def _manifest(url: str, sources: Sources, depth: int) -> list[str]:
    data = await sources.for_url(url).fetch_optional(url)
    if data is None:
        denied = " (or not readable with these credentials)" if _scheme(url) in BUCKET_SCHEMES \
            else ""
        raise NotFound(f"{url}: manifest not found{denied}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ResolveError(f"{url}: manifest is not UTF-8 text") from None
    if url.lower().endswith(".json") or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ResolveError(f"{url}: manifest is not valid JSON: {e}") from None
        return await _wids(doc, url, sources, depth)
    return parse_text_manifest(text, url)


def parse_text_manifest(text: str, url: str) -> list[str]:
    """Shard URLs of a text manifest: one per line, `#` comment lines and blank lines skipped,
    relative entries resolved against the manifest's URL."""
    out = []
    for line in text.splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#"):
            out.append(resolve_ref(entry, url))
    return out


async def _wids(doc: Any, url: str, sources: Sources, depth: int) -> list[str]:
    """Shard URLs of a wids shard index / dataset description, in wids's order: the top-level
    shardlist, then each of "datasets" (inline shardlists, or a `source_url` naming another
    description, fetched)."""
    if not isinstance(doc, dict):
        raise ResolveError(f"{url}: a JSON manifest must be an object (a wids shard index)")
    kind = doc.get("__kind__")
    if kind is not None and kind != WIDS_KIND:
        raise ResolveError(f"{url}: unknown manifest kind {kind!r} (expected {WIDS_KIND!r})")
    if "shardlist" not in doc and "datasets" not in doc:
        raise ResolveError(f"{url}: not a wids shard index: no \"shardlist\"")
    base = _base_dir(doc.get("base"), url)
    out = _shardlist(doc.get("shardlist", []), base, url)
    datasets = doc.get("datasets", [])
    if not isinstance(datasets, list):
        raise ResolveError(f"{url}: \"datasets\" must be a list")
    for component in datasets:
        if not isinstance(component, dict):
            raise ResolveError(f"{url}: every entry of \"datasets\" must be an object")
        if "source_url" in component:
            if depth >= MAX_MANIFEST_DEPTH:
                raise ResolveError(f"{url}: source_url inside a referenced description "
                                   "(wids allows one level of indirection)")
            ref = component["source_url"]
            if not isinstance(ref, str):
                raise ResolveError(f"{url}: source_url must be a string")
            out.extend(await _manifest(resolve_ref(ref, base), sources, depth + 1))
        else:
            sub_base = _base_dir(component.get("base"), base) if "base" in component else base
            out.extend(_shardlist(component.get("shardlist", []), sub_base, url))
    return out


def _shardlist(shardlist: Any, base: str, url: str) -> list[str]:
    if not isinstance(shardlist, list):
        raise ResolveError(f"{url}: \"shardlist\" must be a list")
    out = []
    for i, shard in enumerate(shardlist):
        ref = shard.get("url") if isinstance(shard, dict) else shard
        if not isinstance(ref, str) or not ref:
            raise ResolveError(f"{url}: shardlist[{i}] has no \"url\" string")
        out.append(resolve_ref(ref, base))
    return out


def _base_dir(base: Any, url: str) -> str:
    """The URL relative entries are resolved against: a wids "base" (a directory, itself
    relative to `url`) or `url` itself."""
    if base is None:
        return url
    if not isinstance(base, str) or not base:
        raise ResolveError(f"{url}: \"base\" must be a non-empty string")
    resolved = resolve_ref(base, url)
    return resolved if resolved.endswith("/") else resolved + "/"


def resolve_ref(ref: str, base: str) -> str:
    """A manifest entry -> a URL. Entries with a scheme are kept; with a local (file://) base,
    other entries are file paths (absolute, or relative to the base's directory); otherwise
    they are URL references resolved against `base` (as in HTML; `s3://` and `ais://` too)."""
    if urlsplit(ref).scheme and "://" in ref:
        return ref
    if _scheme(base) == "file":
        base_path = file_path(base)
        directory = base_path if base.endswith("/") else os.path.dirname(base_path)
        path = os.path.normpath(os.path.join(directory, ref))
        return Path(path).as_uri() + ("/" if ref.endswith("/") else "")
    return join_url(base, ref)


def join_url(base: str, ref: str) -> str:
    """RFC 3986 reference resolution for any scheme (urljoin ignores schemes it does not know,
    such as s3://)."""
    parts = urlsplit(base)
    as_http = urlunsplit(("http", parts.netloc, parts.path, parts.query, ""))
    joined = urljoin(as_http, ref)
    return parts.scheme + joined[len("http"):]
