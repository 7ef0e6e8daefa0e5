"""Shards read in place (`in_place`): a file:// shard's own file serves its reads, uncopied.

Copying a shard from a local disk into the cache costs the daemon two copies of every byte,
the cache file's pages and the check of what was written (docs/benchmarks-notes.md, "Shards
read in place"), and the disk space twice, for bytes that a local disk serves as well where
they are. With `in_place`, each plain shard named by a file:// URL is linked into the cache
(ShardCache.link) at mount time, after checking that it is the file the index was made of
(same size and ETag: inode, mtime, size): it is complete from the start, and its members are
read from the file itself, like the cached shards of a mount whose page cache was dropped.

`in_place: auto` (the default) links only the shards on a local file system (util/fstypes.py:
ext4, xfs, btrfs, tmpfs...), and copies those on a network file system as `off` does, and
those on a spinning disk when the cache dir lies on one that does not spin
(fstypes.ShardStorage).

Not linked (copied as without the option): compressed shards (what is cached is the
decompressed tar), shards of other sources, and a file that changed or cannot be opened since
it was indexed (its fetch then fails as usual, naming the change). A linked file replaced
while mounted (a new version renamed over it) is not read at the old index's offsets: each
process opens a link only while the file has the mtime and size it was linked with
(cache.shardcache.open_shard_file), and a replaced one is fetched, which fails naming the
change. A file rewritten in place, keeping its mtime, is read as it is then: the mount holds
no copy to keep it from changing (docs/sources.md, "file://").
"""

from __future__ import annotations

import logging
import os

from shardfs.cache.shardcache import ShardCache
from shardfs.catalog.catalog import Catalog
from shardfs.sources import SourceError
from shardfs.sources.file import file_etag, file_path
from shardfs.util.fstypes import ShardStorage

log = logging.getLogger(__name__)


def link_in_place(catalog: Catalog, cache: ShardCache, local_only: bool = False) -> int:
    """Link every plain file:// shard of the catalog that is unchanged since it was indexed
    (`local_only`, in_place auto: and lies on a local file system); returns how many were
    linked. Blocking (a stat per shard): run it in a thread."""
    linked = 0
    storage = ShardStorage(str(cache.shards_dir)) if local_only else None
    copied: dict[str, int] = {}  # in_place auto: shards left to be copied, by why
    candidates = 0  # plain file:// shards
    for info, key, size, codec in zip(catalog.shards, catalog.keys, catalog.cached_sizes(),
                                      catalog.shard_codecs(), strict=True):
        if codec is not None or size != info.size or not info.url.startswith("file:"):
            continue
        candidates += 1
        try:
            path = file_path(info.url)
            st = os.stat(path)
        except (SourceError, OSError) as exc:
            log.warning("%s: not read in place (%s); copied into the cache when read",
                        info.url, exc)
            continue
        if st.st_size != info.size or (info.etag and file_etag(st) != info.etag):
            log.warning("%s: changed since it was indexed; not read in place", info.url)
            continue
        why = storage.copied_because(st.st_dev) if storage is not None else None
        if why is not None:
            copied[why] = copied.get(why, 0) + 1
            continue
        try:
            cache.link(key, path, size, st.st_mtime_ns)
        except OSError as exc:
            log.warning("%s: cannot link it into the cache (%s); copied when read",
                        info.url, exc.strerror)
            continue
        linked += 1
    if not candidates:
        if not local_only:  # asked for by name (on); auto, the default, has nothing to say
            log.warning("in_place: none of the %d shards is a plain file:// shard (compressed, "
                        "or from another source): every shard is fetched into the cache as "
                        "usual", len(catalog.shards))
        return 0
    log.info("%d of %d shards read in place (linked into %s)", linked, len(catalog.shards),
             cache.shards_dir)
    for why, count in sorted(copied.items()):
        log.info("%d shards %s copied into the cache when read (in_place auto; --in-place "
                 "on reads them in place)", count, why)
    return linked
