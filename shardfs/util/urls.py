"""Shard URLs that carry a query string: a signed URL's token (an Azure SAS, a container-wide
token) rides in it.

- Files that sit beside a shard (its published index, a RecordIO file's `.idx`) are named by
  the shard's path plus a suffix, the query kept: `https://h/c/x.tar?sv=..&sig=..` has its
  index at `https://h/c/x.tar.shardfs.idx?sv=..&sig=..`, not at `...&sig=...shardfs.idx`.
  Only http(s) URLs are taken apart so; in other schemes a `?` is part of the object's name.
- A signature in a query is a credential: `redact` replaces the values of the parameters that
  carry one (a SAS `sig`, `X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`,
  `X-Goog-Signature`, CloudFront's `Signature`/`Policy`/`Key-Pair-Id`, any `token`,
  `key`...) in text bound for a log, an error message or the stats.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_QUERIED = ("http", "https")

# A query parameter whose name says it carries a secret, and its value.
# A value ends at the next parameter, a blank, a quote, or a colon that ends the URL in prose
# ("URL: what went wrong").
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&](?:sig|policy|key|apikey|api_key|key-pair-id|auth|code"
    r"|[\w.-]*(?:signature|token|credential|secret|password))=)"
    r"(?P<value>(?:[^&#\s'\"<>:]|:(?!\s|$))+)",
    re.IGNORECASE)


def _queried(url: str) -> bool:
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in _QUERIED and ("?" in url or "#" in url)


def path_of(url: str) -> str:
    """The part of a URL that names the file, without an http(s) query or fragment."""
    return urlsplit(url).path if _queried(url) else url


def beside(url: str, suffix: str) -> str:
    """The URL of the file named like `url`'s with `suffix` added, beside it (query kept)."""
    if not _queried(url):
        return url + suffix
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path + suffix))


def replace_suffix(url: str, old: str, new: str) -> str | None:
    """`url` with its file name's suffix `old` turned into `new` (query kept); None when the
    name does not end with `old`."""
    if not _queried(url):
        return url[: -len(old)] + new if url.endswith(old) else None
    parts = urlsplit(url)
    if not parts.path.endswith(old):
        return None
    return urlunsplit(parts._replace(path=parts.path[: -len(old)] + new))


def redact(text: str) -> str:
    """`text` with the values of secret-bearing query parameters replaced by REDACTED."""
    if "=" not in text:
        return text
    return _SECRET_PARAM.sub(lambda m: m.group("name") + "REDACTED", text)
