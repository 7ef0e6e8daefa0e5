"""Shards on the Hugging Face Hub: `hf://datasets/ORG/NAME[@REV]/path/to/shard.tar`.

    hf://datasets/ORG/NAME/train/shard-0001.tar
      -> GET {HF_ENDPOINT}/datasets/ORG/NAME/resolve/main/train/shard-0001.tar

The Hub answers a resolve URL of a large (LFS / Xet) file with a redirect to its file store
(a CDN or a presigned object-store URL), which serves byte ranges; small files come from the
Hub itself. Every request goes through the resolve URL (the store's presigned URLs expire),
with `Range`; httpx follows the redirect and drops the Authorization header when it leaves the
Hub's origin, so the token never reaches the file store. Repository kinds: `datasets/`,
`spaces/`, and models (no prefix, or `models/`). REV is a branch, tag or commit (a commit pins
the data; `/` in a branch name is written `%2F`, as huggingface_hub does).

Token (gated and private repositories): $HF_TOKEN, else the file $HF_TOKEN_PATH, else
$HF_HOME/token (default ~/.cache/huggingface/token, written by `huggingface-cli login`).
The endpoint: settings.hf_endpoint, else $HF_ENDPOINT, else https://huggingface.co.

The Hub's resolve endpoint has its own ETag, not the file store's, so ranged GETs carry no
If-Match; instead every 206 answer's size and ETag are compared with those recorded at mount
time (HttpSource._check_partial), which detects a changed file just the same.

Tested against a loopback stand-in of the Hub and its file store (tests/test_hf_gs.py), not
against huggingface.co (no network in CI).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import httpx

from shardfs.sources.base import NotFound, SourceError, SourceSettings
from shardfs.sources.budget import RequestBudget
from shardfs.sources.http import HttpSource, Response

DEFAULT_ENDPOINT = "https://huggingface.co"
_KINDS = {"datasets": "/datasets", "spaces": "/spaces", "models": ""}


def hf_to_https(url: str, endpoint: str) -> str:
    """The Hub resolve URL of an hf:// URL."""
    if not url[:5].lower() == "hf://":
        raise SourceError(f"{url}: not an hf:// URL")
    parts = url[5:].split("/")
    kind = parts.pop(0) if parts and parts[0] in _KINDS else "models"
    if len(parts) < 3 or not parts[0] or not parts[1] or not parts[-1]:
        raise SourceError(f"{url}: expected hf://datasets/ORG/NAME[@REV]/PATH (or spaces/..., "
                          "or a model ORG/NAME[@REV]/PATH)")
    org, name = parts[0], parts[1]
    name, _, rev = name.partition("@")
    rev = unquote(rev) if rev else "main"
    path = "/".join(parts[2:])
    return (f"{endpoint}{_KINDS[kind]}/{quote(org)}/{quote(name)}/resolve/{quote(rev, safe='')}"
            f"/{quote(path)}")


def find_token(env: Mapping[str, str]) -> str | None:
    """The Hub token as huggingface_hub finds it (None: anonymous)."""
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token.strip()
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or "~", ".cache"),
        "huggingface")
    path = env.get("HF_TOKEN_PATH") or os.path.join(home, "token")
    try:
        text = Path(os.path.expanduser(path)).read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SourceError(f"cannot read the Hugging Face token file {path}: {e.strerror}") \
            from None
    return text or None


class HfSource(HttpSource):
    """Files of Hugging Face Hub repositories, read by range through resolve URLs."""

    def __init__(self, settings: SourceSettings | None = None, *,
                 env: Mapping[str, str] | None = None,
                 budget: RequestBudget | None = None) -> None:
        super().__init__(settings, budget=budget)
        env = os.environ if env is None else env
        endpoint = (self.settings.hf_endpoint or env.get("HF_ENDPOINT")
                    or DEFAULT_ENDPOINT).rstrip("/")
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SourceError(f"Hugging Face endpoint {endpoint!r}: expected http(s)://HOST")
        self.endpoint = endpoint
        self._token = find_token(env)
        self.credential_method = "hf-token" if self._token else "anonymous"

    def _build_request(self, url: str, headers: dict[str, str]) -> httpx.Request:
        sent = {k: v for k, v in headers.items()
                if k.lower() not in ("if-match", "if-unmodified-since")}
        if self._token:
            # Only for the Hub's origin: httpx drops it on a redirect to another origin.
            sent["Authorization"] = f"Bearer {self._token}"
        return self._client.build_request("GET", self._parsed(hf_to_https(url, self.endpoint)),
                                          headers=sent)

    def _status_error(self, resp: Response, url: str) -> Exception:
        status = resp.status_code
        code = resp.headers.get("x-error-code", "")
        if status in (401, 403):
            self.stats.errors += 1
            login = ("the token was refused" if self._token else
                     "no token: set HF_TOKEN or run `huggingface-cli login`")
            if code == "GatedRepo" or status == 403:
                return SourceError(f"{url}: the repository is gated: accept its conditions on "
                                   f"the Hub with the token's account ({login}) (HTTP {status})")
            return SourceError(f"{url}: repository not found, or private ({login}) "
                               f"(HTTP {status}{' ' + code if code else ''})")
        if status == 404:
            self.stats.errors += 1
            what = "no such file in the repository" if code == "EntryNotFound" else \
                "not found (repository, revision or file)"
            return NotFound(f"{url}: {what} (HTTP 404{' ' + code if code else ''})")
        return super()._status_error(resp, url)
