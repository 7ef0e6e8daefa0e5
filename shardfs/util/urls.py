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
- A signature does not say which bytes a URL names: `unsigned` drops the parameters that make
  up a signature (the secret ones above, and their companions: a SAS's `sv`/`se`/`sp`...,
  `X-Amz-Date`/`X-Amz-Expires`..., `Expires`) and keeps any other (`versionId`,
  `generation`, `snapshot` select content). A shard's cache identity is built from it, so a
  mount with a fresh token finds the shards and indexes a mount with the old one cached
  (size and validators still have to match).
- A signature expires: `signed_until` reads when from the query (a SAS's `se`, SigV4's and
  Google's V4 `X-Amz-Date`/`X-Goog-Date` plus `...-Expires`, an `Expires` time stamp of SigV2,
  Google's V2 and CloudFront), for `doctor` and the mount's log.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

_QUERIED = ("http", "https")

# A query parameter whose name says it carries a secret, and its value.
# A value ends at the next parameter, a blank, a quote, or a colon that ends the URL in prose
# ("URL: what went wrong").
_SECRET_NAME = (r"(?:sig|policy|key|apikey|api_key|key-pair-id|auth|code"
                r"|[\w.-]*(?:signature|token|credential|secret|password))")
_SECRET_PARAM = re.compile(
    rf"(?P<name>[?&]{_SECRET_NAME}=)"
    r"(?P<value>(?:[^&#\s'\"<>:]|:(?!\s|$))+)",
    re.IGNORECASE)
_SECRET_NAME_ONLY = re.compile(_SECRET_NAME, re.IGNORECASE)


# Parameters that are part of a signature but carry no secret, by their lower-cased names:
# an Azure SAS's (service, account and user delegation SAS: version, services, resource types,
# permissions, start, expiry, IP, protocol, resource, policy id, directory depth, encryption
# scope, the delegation key's fields, response header overrides), SigV4's and Google's V4
# signing fields, and the expiry and key id of SigV2, Google's V2 and CloudFront signatures.
_SIGNING_PARAMS = frozenset({
    "sv", "ss", "srt", "sp", "st", "se", "sip", "spr", "sr", "si", "sdd", "ses",
    "skoid", "sktid", "skt", "ske", "sks", "skv", "saoid", "suoid", "scid",
    "rscc", "rscd", "rsce", "rscl", "rsct",
    "x-amz-algorithm", "x-amz-date", "x-amz-expires", "x-amz-signedheaders",
    "x-goog-algorithm", "x-goog-date", "x-goog-expires", "x-goog-signedheaders",
    "awsaccesskeyid", "googleaccessid", "expires",
})


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


def unsigned(url: str) -> str:
    """`url` without the query parameters that make up a signature (see the module's
    docstring); the others kept in their order. URLs without a query (and other schemes than
    http(s)) come back unchanged."""
    if not _queried(url):
        return url
    parts = urlsplit(url)
    if not parts.query:
        return url
    kept = [p for p in parts.query.split("&") if not _signing(p)]
    return urlunsplit(parts._replace(query="&".join(kept)))


def _signing(param: str) -> bool:
    name = unquote(param.partition("=")[0])
    return name.lower() in _SIGNING_PARAMS or _SECRET_NAME_ONLY.fullmatch(name) is not None


# A signature expiring sooner than this is worth a warning (doctor, the log, top).
EXPIRES_SOON_S = 24 * 3600


def signed_until(url: str) -> float | None:
    """When the signature in `url`'s query expires, as a Unix time; None when it carries no
    expiry shardfs can read (or is not an http(s) URL)."""
    return query_signed_until(urlsplit(url).query) if _queried(url) else None


def earliest_signed_until(urls: Iterable[str]) -> float | None:
    """The earliest `signed_until` of `urls`; None when none says."""
    return min((t for t in map(signed_until, urls) if t is not None), default=None)


def query_signed_until(query: str) -> float | None:
    """When the signature in a query (the text after `?`) expires; None when it does not
    say."""
    params = {k.lower(): v for k, v in parse_qsl(query)}
    found = []
    if "se" in params:  # an Azure SAS: ISO 8601, a date or a time in UTC
        found.append(_iso_time(params["se"]))
    for prefix in ("x-amz-", "x-goog-"):
        date, expires = params.get(prefix + "date"), params.get(prefix + "expires")
        if date and expires and expires.isdigit():
            start = _iso_time(date)
            found.append(None if start is None else start + int(expires))
    if params.get("expires", "").isdigit():
        found.append(float(params["expires"]))
    times = [t for t in found if t is not None]
    return min(times) if times else None


def _iso_time(text: str) -> float | None:
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%MZ", "%Y%m%dT%H%M%SZ", "%Y-%m-%d"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            continue
    return None
