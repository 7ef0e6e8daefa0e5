"""Shards in S3 and S3-compatible stores (MinIO, Ceph RGW, AIStore's /s3 API): `s3://bucket/key`.

Requests are plain HTTP GETs signed with AWS Signature V4 (sigv4.py; no boto in the daemon),
so all of HttpSource's machinery applies unchanged: `bytes=0-0` stat, resumable ranged streams
with If-Match, retries with backoff, the no-progress deadline. What S3 adds is the mapping from
`s3://` URLs to endpoint URLs, signing, credentials and region discovery, S3's XML error bodies
(turned into messages that say what to fix), and ListObjectsV2 for prefixes.

Object keys are taken literally from the URL (everything after `s3://bucket/`, no
percent-decoding), as the AWS CLI does.
"""

from __future__ import annotations

import configparser
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote_plus, urlsplit

import httpx

from shardfs.sources.base import (
    NotFound,
    RangeNotSupported,
    ShardChanged,
    ShardInfo,
    SourceError,
    SourceSettings,
)
from shardfs.sources.budget import RequestBudget
from shardfs.sources.credentials import AwsCredentials
from shardfs.sources.h1 import RequestHead
from shardfs.sources.http import (
    RETRYABLE,
    HttpSource,
    Response,
    _Attempt,
    _parse_content_range,
    _Patience,
    _Retry,
    _retry_after,
    sent_headers,
)
from shardfs.sources.sigv4 import EMPTY_SHA256, Credentials, canonical_query, sign, uri_encode

log = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
ADDRESSING = ("auto", "path", "virtual")
LIST_PAGE_SIZE = 1000  # S3's own maximum per ListObjectsV2 page
_MAX_ERROR_BODY = 64 * 1024
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_TRUE = ("1", "true", "yes", "on")
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
# Refusals that mean "this key is no longer (or not yet) valid": obtain credentials again.
REAUTH_CODES = frozenset({"ExpiredToken", "InvalidAccessKeyId", "InvalidToken",
                          "TokenRefreshRequired"})
# A store may answer a plain 403 once a temporary key has expired.
REAUTH_IF_TEMPORARY = frozenset({"AccessDenied", "SignatureDoesNotMatch", ""})


# -- URLs ------------------------------------------------------------------------------------


def split_bucket_url(url: str, scheme: str = "s3") -> tuple[str, str]:
    """`s3://bucket/some/key.tar` -> ("bucket", "some/key.tar"); the key may be empty."""
    head = f"{scheme}://"
    if not url[: len(head)].lower() == head:
        raise SourceError(f"{url}: not an {scheme}:// URL")
    bucket, _, key = url[len(head) :].partition("/")
    if not bucket:
        raise SourceError(f"{url}: no bucket name ({scheme}://BUCKET/KEY)")
    return bucket, key


# -- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class S3Config:
    """Where requests go and how they are signed; secrets stay inside `credentials`."""

    region: str = DEFAULT_REGION
    endpoint: str | None = None  # scheme://host[:port][/path] of an S3-compatible store
    addressing: str = "auto"  # auto: virtual-hosted on AWS, path-style on custom endpoints
    # Fixed credentials (the shardfs config's, or a test's); None: see `chain`.
    credentials: Credentials | None = None
    # With no fixed credentials: True, find them as the AWS SDKs do (sources/credentials.py;
    # none found: unsigned); False: always unsigned (AIStore).
    chain: bool = False
    profile: str | None = None  # the named profile the chain uses (None: AWS_PROFILE/default)

    def describe(self) -> str:
        """For logs and messages: never includes a secret."""
        if self.credentials:
            who = self.credentials.source
        elif self.chain:
            who = "the AWS credential chain" + (f", profile {self.profile!r}"
                                                if self.profile else "")
        else:
            who = "anonymous (unsigned requests)"
        where = self.endpoint or f"AWS S3 ({self.region})"
        return f"{where}, region {self.region}, {self.addressing} addressing, credentials: {who}"


def _read_ini(path: str) -> configparser.ConfigParser | None:
    parser = configparser.ConfigParser(interpolation=None, strict=False, default_section="\0")
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, configparser.Error) as e:
        raise SourceError(f"cannot read AWS config file {path}: {e}") from None
    return parser


def _nested(value: str) -> dict[str, str]:
    """The sub-settings of a nested config value (`s3 =\\n  addressing_style = path`)."""
    out = {}
    for line in value.splitlines():
        name, sep, val = line.partition("=")
        if sep:
            out[name.strip().lower()] = val.strip()
    return out


def load_s3_config(settings: SourceSettings, env: Mapping[str, str] | None = None) -> S3Config:
    """Region, endpoint, addressing and credentials the way the AWS CLI/SDKs find them.

    Credentials: the shardfs config's (settings.s3_credentials), else the AWS SDKs' chain,
    resolved by botocore when the first request is signed (sources/credentials.py), with
    the profile settings.s3_profile or AWS_PROFILE. Region: settings.s3_region, AWS_REGION,
    AWS_DEFAULT_REGION, the profile's `region`, us-east-1. Endpoint: settings.s3_endpoint,
    AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's `s3 = endpoint_url` or `endpoint_url`
    (env and file endpoints are ignored when AWS_IGNORE_CONFIGURED_ENDPOINT_URLS is true)."""
    env = os.environ if env is None else env
    home = env.get("HOME") or os.path.expanduser("~")
    explicit_profile = settings.s3_profile or env.get("AWS_PROFILE") or None
    profile = explicit_profile or "default"
    cred_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    conf_path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    cred_file = _read_ini(os.path.expanduser(cred_path))
    conf_file = _read_ini(os.path.expanduser(conf_path))
    cred_section = cred_file[profile] if cred_file and cred_file.has_section(profile) else {}
    conf_name = profile if profile == "default" else f"profile {profile}"
    conf_section = conf_file[conf_name] if conf_file and conf_file.has_section(conf_name) else {}
    if explicit_profile and not cred_section and not conf_section:
        raise SourceError(
            f"AWS profile {profile!r} not found in {cred_path} or {conf_path}"
        )
    s3_nested = _nested(conf_section.get("s3", ""))

    credentials = _config_credentials(settings)

    region = (settings.s3_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
              or conf_section.get("region") or DEFAULT_REGION).strip()

    endpoint = settings.s3_endpoint
    if not endpoint and env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() not in _TRUE:
        endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                    or s3_nested.get("endpoint_url") or conf_section.get("endpoint_url"))
    addressing = settings.s3_addressing
    if addressing == "auto" and s3_nested.get("addressing_style") in ("path", "virtual"):
        addressing = s3_nested["addressing_style"]
    return S3Config(region=region, endpoint=_check_endpoint(endpoint) if endpoint else None,
                    addressing=_check_addressing(addressing), credentials=credentials,
                    chain=credentials is None, profile=explicit_profile)


def _config_credentials(settings: SourceSettings) -> Credentials | None:
    given = settings.s3_credentials
    if not given:
        return None
    if not given.get("access_key_id") or not given.get("secret_access_key"):
        raise SourceError("incomplete credentials in the shardfs config: need both "
                          "access_key_id and secret_access_key")
    return Credentials(given["access_key_id"], given["secret_access_key"],
                       given.get("session_token"), source="the shardfs config")


def _check_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise SourceError(f"S3 endpoint {endpoint!r}: expected http(s)://HOST[:PORT][/PATH]")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def _check_addressing(addressing: str) -> str:
    if addressing not in ADDRESSING:
        raise SourceError(f"S3 addressing {addressing!r}: expected one of {', '.join(ADDRESSING)}")
    return addressing


# -- listing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listing:
    """Objects directly under a prefix (URLs, in the store's order) and the sub-prefixes
    ("directories") next to them."""

    urls: list[str]
    prefixes: list[str]


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child_text(elem: ET.Element, name: str) -> str | None:
    for child in elem:
        if _local(child.tag) == name:
            return child.text or ""
    return None


# -- the source ------------------------------------------------------------------------------


class S3Source(HttpSource):
    """Shards named `s3://bucket/key`, fetched with SigV4-signed ranged GETs."""

    scheme = "s3"

    def __init__(self, settings: SourceSettings | None = None, *,
                 env: Mapping[str, str] | None = None, config: S3Config | None = None,
                 budget: RequestBudget | None = None) -> None:
        super().__init__(settings, budget=budget)
        self.config = config or self._load_config(self.settings, env)
        cfg = self.config
        # No credentials object at all for unsigned sources: botocore is never imported.
        self.auth = (AwsCredentials(profile=cfg.profile, region=cfg.region,
                                    fixed=cfg.credentials,
                                    stats=self.stats, label=f"{self.scheme}://")
                     if cfg.credentials is not None or cfg.chain else None)
        self._signing: Credentials | None = cfg.credentials
        log.debug("%s:// source: %s", self.scheme, cfg.describe())

    def take_over(self, earlier: HttpSource) -> None:
        super().take_over(earlier)
        if self.auth is not None and isinstance(earlier, S3Source) and earlier.auth is not None:
            self.auth.adopt(earlier.auth)  # the same credentials, refreshed when they expire

    @property
    def credential_method(self) -> str | None:
        """botocore's name of the provider the requests are signed with (for stats/logs)."""
        if self.auth is None:
            return "anonymous"
        return self.auth.method

    async def _before_attempt(self) -> None:
        await super()._before_attempt()
        if self.auth is not None:
            self._signing = await self.auth.current()

    @staticmethod
    def _load_config(settings: SourceSettings, env: Mapping[str, str] | None) -> S3Config:
        return load_s3_config(settings, env)

    # -- requests -----------------------------------------------------------------------------

    def _virtual(self, bucket: str) -> bool:
        mode = self.config.addressing
        if mode == "auto":
            # Custom endpoints rarely have wildcard DNS; dotted names break TLS on AWS.
            return self.config.endpoint is None and bool(_DNS_BUCKET.match(bucket))
        return mode == "virtual"

    def _target(self, bucket: str, key: str | None) -> tuple[str, str, str]:
        """(scheme, netloc, encoded path) for an object (key) or a bucket (key None)."""
        if self.config.endpoint:
            parts = urlsplit(self.config.endpoint)
            scheme, netloc, base = parts.scheme, parts.netloc, parts.path
        else:
            suffix = ".amazonaws.com.cn" if self.config.region.startswith("cn-") else \
                ".amazonaws.com"
            scheme, netloc, base = "https", f"s3.{self.config.region}{suffix}", ""
        if self._virtual(bucket):
            netloc = f"{bucket}.{netloc}"
            path = base + "/"
        else:
            path = f"{base}/{uri_encode(bucket, keep_slash=False)}"
            if key is not None:
                path += "/"
        if key is not None:
            path += uri_encode(key, keep_slash=True)
        return scheme, netloc, path

    def _signed(self, url: str, bucket: str, key: str | None, query: str,
                headers: dict[str, str]) -> httpx.Request:
        request = self._unsigned(url, bucket, key, query, headers)
        path = request.url.raw_path.decode("ascii").partition("?")[0]
        request.headers.update(self._signature(request.headers["host"], path, query, headers))
        return request

    def _unsigned(self, url: str, bucket: str, key: str | None, query: str,
                  headers: dict[str, str]) -> httpx.Request:
        scheme, netloc, path = self._target(bucket, key)
        target = f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")
        request = self._client.build_request("GET", target, headers=headers)
        sent = path + (f"?{query}" if query else "")
        if request.url.raw_path != sent.encode("ascii"):  # what we sign must be what is sent
            raise SourceError(f"{url}: the HTTP client rewrote the request path "
                              f"({request.url.raw_path!r} instead of {sent!r})")
        return request

    def _signature(self, host: str, path: str, query: str,
                   headers: dict[str, str]) -> dict[str, str]:
        """The SigV4 headers of a GET (none for an unsigned source); `path` and `query` as
        sent on the request line."""
        creds = self._signing
        if creds is None:
            return {}
        signed_headers = {name.lower(): value for name, value in headers.items()}
        return sign(creds, "GET", host=host, path=path, query=query, headers=signed_headers,
                    region=self.config.region, service="s3", payload_hash=EMPTY_SHA256)

    def _object(self, url: str) -> tuple[str, str]:
        bucket, key = split_bucket_url(url, self.scheme)
        if not key:
            raise SourceError(f"{url}: names a bucket, not an object")
        return bucket, key

    def _build_request(self, url: str, headers: dict[str, str]) -> httpx.Request:
        return self._signed(url, *self._object(url), "", headers)

    # A GET of an object goes as h1.RequestHead bytes (HttpSource._head) with its signature
    # added: the same bytes as the signed httpx.Request, without building one. A subclass
    # that adds its own authorization says so (GsSource: its OAuth bearer).
    def _lean_requests(self) -> bool:
        return type(self)._signed is S3Source._signed and \
            type(self)._build_request is S3Source._build_request

    def _unsigned_request(self, url: str) -> httpx.Request:
        return self._unsigned(url, *self._object(url), "", {})

    def _lean_headers(self, head: RequestHead, headers: dict[str, str]) -> dict[str, str]:
        return headers | self._signature(head.host, head.path, "", headers)

    # -- stat -------------------------------------------------------------------------------

    async def _stat_once(self, url: str) -> ShardInfo:
        async with self._request(url, {"Range": "bytes=0-0"}) as resp:
            status = resp.status_code
            if status == 206:
                size = _parse_content_range(resp, url)[2]
            elif status == 200 and resp.headers.get("content-length") == "0":
                size = 0
            elif status == 200:
                raise RangeNotSupported(
                    f"{url}: the store ignored a Range request (HTTP 200 instead of 206)")
            else:
                code, message, fields = await self._error_body(resp)
                if status != 416 or fields.get("ActualObjectSize") != "0":
                    raise self._failure(resp, url, code, message)
                size = 0  # an empty object: S3 refuses every range of it (416 InvalidRange)
            if not resp.is_stream_consumed:
                await self._read_small(resp, url)  # let the connection be reused
            return ShardInfo(url=url, size=size, etag=resp.headers.get("etag"),
                             last_modified=resp.headers.get("last-modified"))

    # -- stream -----------------------------------------------------------------------------

    async def _check_partial(self, resp: Response, shard: ShardInfo, pos: int,
                             end: int) -> int:
        if resp.status_code in (301, 307, 400, 401, 403):
            code, message, _ = await self._error_body(resp)
            raise self._failure(resp, shard.url, code, message)
        return await super()._check_partial(resp, shard, pos, end)

    # -- fetch_optional ---------------------------------------------------------------------

    async def _fetch_once(self, url: str) -> bytes | None:
        async with self._request(url, {}) as resp:
            if resp.status_code == 200:
                return await self._read_small(resp, url)
            code, message, _ = await self._error_body(resp)
            if resp.status_code == 404 and code != "NoSuchBucket":
                return None
            if resp.status_code == 403 and code == "AccessDenied":
                # S3 answers 403 for a missing key unless s3:ListBucket is granted; the
                # credentials work (the shard itself was readable), so treat it as absent.
                log.debug("%s: access denied; treating it as absent", url)
                return None
            raise self._failure(resp, url, code, message)

    # -- listing ----------------------------------------------------------------------------

    async def list_prefix(self, url: str, *, page_size: int = LIST_PAGE_SIZE) -> Listing:
        """Objects whose keys start with the URL's key and have no further `/` after it
        (ListObjectsV2 with delimiter `/`, every page), as URLs of this scheme."""
        bucket, prefix = split_bucket_url(url, self.scheme)
        head = f"{self.scheme}://{bucket}/"
        urls: list[str] = []
        prefixes: list[str] = []
        token: str | None = None
        while True:
            params = [("list-type", "2"), ("prefix", prefix), ("delimiter", "/"),
                      ("encoding-type", "url"), ("max-keys", str(page_size))]
            if token:
                params.append(("continuation-token", token))
            root = await self._list_page(url, bucket, canonical_query(params))
            encoded = (_child_text(root, "EncodingType") or "") == "url"
            decode = unquote_plus if encoded else (lambda s: s)
            for elem in root:
                name = _local(elem.tag)
                if name == "Contents":
                    urls.append(head + decode(_child_text(elem, "Key") or ""))
                elif name == "CommonPrefixes":
                    prefixes.append(head + decode(_child_text(elem, "Prefix") or ""))
            truncated = (_child_text(root, "IsTruncated") or "").lower() == "true"
            token = _child_text(root, "NextContinuationToken")
            if not truncated:
                return Listing(urls, prefixes)
            if not token:
                raise SourceError(f"{url}: truncated listing without a continuation token")

    async def _list_page(self, url: str, bucket: str, query: str) -> ET.Element:
        patience = _Patience(url, self.settings, self.stats, self._down)
        while True:
            try:
                page = await self._list_page_once(url, bucket, query)
            except _Retry as failure:
                await patience.wait(failure)
            else:
                patience.progress()
                return page

    async def _list_page_once(self, url: str, bucket: str, query: str) -> ET.Element:
        build = lambda: self._signed(url, bucket, None, query, {})  # noqa: E731
        async with _Attempt(self, url, build) as resp:
            if resp.status_code != 200:
                code, message, _ = await self._error_body(resp)
                raise self._failure(resp, url, code, message, listing=True)
            body = await self._read_small(resp, url)
        try:
            root = ET.fromstring(body)
        except ET.ParseError as e:
            raise SourceError(f"{url}: unreadable ListObjectsV2 answer: {e}") from None
        if _local(root.tag) != "ListBucketResult":
            raise SourceError(f"{url}: unexpected answer to ListObjectsV2 ({_local(root.tag)})")
        return root

    # -- errors -----------------------------------------------------------------------------

    async def _error_body(self, resp: Response) -> tuple[str, str, dict[str, str]]:
        """(Code, Message, all fields) of an S3 XML error body; empty when there is none."""
        body = b""
        async for data in resp.aiter_raw():
            body += data
            if len(body) > _MAX_ERROR_BODY:
                break
        fields: dict[str, str] = {}
        try:
            root = ET.fromstring(body) if body.strip() else None
        except ET.ParseError:
            root = None
        if root is not None:
            for child in root:
                fields[_local(child.tag)] = (child.text or "").strip()
        return fields.get("Code", ""), fields.get("Message", ""), fields

    def _who(self) -> str:
        """Which credentials signed the requests, for messages (never a secret)."""
        creds = self._signing
        return (f"access key {creds.access_key} from {creds.source}" if creds
                else "an anonymous request (no AWS credentials found)")

    def _reauthorize(self, resp: Response, code: str) -> bool:
        """Whether a refusal may be the signing key's expiry or rotation: then the
        credentials are obtained again (once) and the request is retried."""
        if self.auth is None or not (code in REAUTH_CODES or (
                resp.status_code == 403 and self.auth.temporary and code in REAUTH_IF_TEMPORARY)):
            return False
        sent = sent_headers(resp)
        match = _CREDENTIAL.search(sent.get("authorization", ""))
        return self.auth.invalidate(match.group(1) if match else None,
                                    sent.get("x-amz-security-token"))

    def _failure(self, resp: Response, url: str, code: str, message: str, *,
                 listing: bool = False) -> Exception:
        """The exception for an S3 error answer, phrased to say what to fix."""
        status = resp.status_code
        label = f"HTTP {status}" + (f" {code}" if code else "")
        if status >= 500 or status in RETRYABLE or code in ("SlowDown", "RequestTimeout"):
            return self._retry(label, _retry_after(resp.headers.get("retry-after")))
        if self._reauthorize(resp, code):
            return self._retry(f"{label}; refreshing the credentials", 0.0)
        self.stats.errors += 1
        bucket, key = split_bucket_url(url, self.scheme)
        what = f"bucket {bucket!r}" + (f", key {key!r}" if key and not listing else "")
        who = self._who()
        where = self.config.endpoint or "AWS S3"
        region = resp.headers.get("x-amz-bucket-region")
        if region and region != self.config.region:
            return SourceError(
                f"{url}: {what} is in region {region}, but requests were signed for "
                f"{self.config.region}: set AWS_REGION={region} ({label})")
        if status == 404:
            if code == "NoSuchBucket":
                return NotFound(f"{url}: no such bucket {bucket!r} at {where} ({label})")
            return NotFound(f"{url}: not found: no key {key!r} in bucket {bucket!r} ({label})")
        if status == 412:
            return ShardChanged(f"{url}: changed since mount time ({label})")
        causes = {
            "SignatureDoesNotMatch": (
                f"the request signature does not match: the secret key is wrong for {who} "
                "(check AWS_SECRET_ACCESS_KEY or aws_secret_access_key), or the endpoint "
                "rewrites requests"),
            "InvalidAccessKeyId": f"{where} does not know {who}",
            "InvalidToken": f"the session token of {who} is not valid",
            "ExpiredToken": f"the session token of {who} has expired: refresh the credentials",
            "TokenRefreshRequired": f"the session token of {who} has expired",
            "RequestTimeTooSkewed": (
                "this machine's clock differs from the store's by more than 15 minutes"),
            "AuthorizationHeaderMalformed": (
                f"the store rejected the signature's scope (region {self.config.region}); "
                f"is AWS_REGION right? {message}"),
            "PermanentRedirect": (
                f"{what} must be addressed through another endpoint or region: {message}"),
            "AllAccessDisabled": f"all access to {what} is disabled",
        }
        if code in causes:
            return SourceError(f"{url}: {causes[code]} ({label})")
        if status == 403 or code == "AccessDenied":
            need = "s3:ListBucket" if listing else "s3:GetObject"
            hint = ("" if listing else
                    "; S3 also answers 403 instead of 404 for a missing key when the "
                    "credentials lack s3:ListBucket")
            return SourceError(f"{url}: access denied to {what} for {who}: it needs {need} "
                               f"permission{hint} ({label})")
        detail = f": {message}" if message else ""
        return SourceError(f"{url}: the store refused the request ({label}){detail}")
