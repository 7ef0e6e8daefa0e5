"""Google Cloud Storage: `gs://bucket/key`, through GCS's XML API (S3-like).

    gs://B/K -> GET {endpoint}/B/K  (endpoint: settings.gs_endpoint, $STORAGE_EMULATOR_HOST,
                                      else https://storage.googleapis.com)

It is S3Source with another endpoint and other credentials, so ranges, If-Match, resume,
retries, errors and ListObjectsV2 listings (for `gs://bucket/prefix/`) are S3's. Credentials,
first found wins:

1. HMAC keys (GCS's S3 interoperability): $GS_ACCESS_KEY_ID + $GS_SECRET_ACCESS_KEY, signed
   with SigV4 (region `auto`) exactly like s3://.
2. An OAuth2 bearer token:
   - $GOOGLE_OAUTH_ACCESS_TOKEN (a token you obtained, e.g. `gcloud auth print-access-token`;
     never refreshed);
   - a credentials file: $GOOGLE_APPLICATION_CREDENTIALS, else
     ~/.config/gcloud/application_default_credentials.json (`gcloud auth
     application-default login`). A user's (`authorized_user`): its refresh token is traded
     at its `token_uri` for access tokens (here, on the loop). Any other kind, by google-auth
     (the library Google's clients use; in a thread), scoped to read-only storage: a
     service-account key (`service_account`: a JWT signed RS256, traded at its `token_uri`),
     workload identity federation (`external_account`: a token from AWS, Azure, an OIDC
     provider or a file, exchanged at Google's STS), an impersonated service account;
   - the metadata server (GCE, GKE workload identity, Cloud Run): $GCE_METADATA_HOST, default
     metadata.google.internal, `/computeMetadata/v1/instance/service-accounts/default/token`
     with `Metadata-Flavor: Google`.
   Tokens are refreshed ahead of expiry (at half their lifetime, at most 5 minutes before),
   one refresh at a time; a 401 forces one refresh and a retry.
3. Nothing: unsigned requests (public buckets).

Tested against a loopback stand-in of the XML API, the OAuth token endpoint and the metadata
server (tests/test_hf_gs.py), not against Google Cloud (no network in CI).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import trio

from shardfs.sources.base import SourceError, SourceSettings, SourceStats
from shardfs.sources.budget import RequestBudget
from shardfs.sources.h1 import RequestHead
from shardfs.sources.http import Response, sent_headers
from shardfs.sources.s3 import S3Config, S3Source, _check_endpoint
from shardfs.sources.sigv4 import Credentials

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
DEFAULT_TOKEN_URI = "https://oauth2.googleapis.com/token"
READ_ONLY_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
FILE_TIMEOUT_S = 10.0  # per connect and per read of a token request made for a file
METADATA_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
EARLY_S = 5 * 60.0  # refresh at most this long before expiry (at half-life when shorter)


def load_gs_config(settings: SourceSettings, env: Mapping[str, str]) -> S3Config:
    endpoint = settings.gs_endpoint or env.get("STORAGE_EMULATOR_HOST") or DEFAULT_ENDPOINT
    key, secret = env.get("GS_ACCESS_KEY_ID"), env.get("GS_SECRET_ACCESS_KEY")
    if bool(key) != bool(secret):
        missing = "GS_SECRET_ACCESS_KEY" if key else "GS_ACCESS_KEY_ID"
        raise SourceError(f"incomplete GCS HMAC key in the environment: {missing} is not set")
    creds = Credentials(key, secret, None, "GCS HMAC key (GS_ACCESS_KEY_ID)") if key and \
        secret else None
    return S3Config(region="auto", endpoint=_check_endpoint(endpoint), addressing="path",
                    credentials=creds, chain=False)


class GoogleToken:
    """OAuth2 access tokens for GCS, obtained and refreshed on the trio loop (httpx)."""

    def __init__(self, env: Mapping[str, str], client: httpx.AsyncClient,
                 stats: SourceStats) -> None:
        self._env = env
        self._client = client
        self._stats = stats
        self._token: str | None = None
        self._expiry: float | None = None
        self._refresh_at = 0.0
        self._resolved = False
        self._lock = trio.Lock()
        self._forced_token: str | None = None
        self.method = "not yet resolved"

    async def current(self) -> str | None:
        now = time.time()
        if self._resolved and now < self._refresh_at:
            return self._token
        if self._lock.locked() and self._token and self._expiry and now < self._expiry:
            return self._token  # a refresh is running; the current token is still good
        async with self._lock:
            if not self._resolved or time.time() >= self._refresh_at:
                await self._obtain()
        return self._token

    def invalidate(self, sent: str | None) -> bool:
        """A request with bearer `sent` got 401: refresh once and retry (True)."""
        if self._token is None or self._expiry is None:
            return False  # a fixed token cannot be refreshed
        if sent != self._token:
            return True
        if self._token == self._forced_token:
            return False
        self._forced_token = self._token
        self._refresh_at = 0.0
        return True

    async def _obtain(self) -> None:
        had = self._resolved
        try:
            token, lifetime, method = await self._fetch()
        except SourceError as e:
            if not self._keep_current(f"refreshing the token failed: {e}"):
                raise
            return
        if token is None and self._keep_current("the metadata server did not answer"):
            return
        now = time.time()
        self._token, self.method, self._resolved = token, method, True
        if lifetime is None:
            self._expiry, self._refresh_at = None, float("inf")
        else:
            self._expiry = now + lifetime
            self._refresh_at = self._expiry - min(EARLY_S, lifetime / 2)
        if self._forced_token is not None and token != self._forced_token:
            self._forced_token = token
        if had:
            self._stats.credential_refreshes += 1
        log.info("gs://: using %s%s", method,
                 f" (token expires in {lifetime:.0f} s)" if lifetime is not None else "")

    def _keep_current(self, why: str) -> bool:
        """After a failed refresh: keep signing with the current token while it is valid
        (True), and try again soon."""
        now = time.time()
        if self._token is None or self._expiry is None or now >= self._expiry:
            return False
        self._refresh_at = now + min(30.0, max(1.0, (self._expiry - now) / 4))
        log.warning("gs://: %s; keeping the current token (expires in %.0f s)", why,
                    self._expiry - now)
        return True

    async def _fetch(self) -> tuple[str | None, float | None, str]:
        env = self._env
        if env.get("GOOGLE_OAUTH_ACCESS_TOKEN"):
            return env["GOOGLE_OAUTH_ACCESS_TOKEN"].strip(), None, \
                "access token from GOOGLE_OAUTH_ACCESS_TOKEN"
        adc = await trio.to_thread.run_sync(self._adc_file)
        if adc is None:
            return await self._metadata()
        path, doc = adc
        if doc.get("type") == "authorized_user":
            return await self._refresh_user(path, doc)
        token, lifetime = await trio.to_thread.run_sync(token_from_file, path, doc)
        return token, lifetime, describe_file(path, doc)

    def _adc_file(self) -> tuple[str, dict] | None:
        env = self._env
        explicit = env.get("GOOGLE_APPLICATION_CREDENTIALS")
        config_dir = env.get("CLOUDSDK_CONFIG") or os.path.join(
            env.get("HOME") or os.path.expanduser("~"), ".config", "gcloud")
        path = explicit or os.path.join(config_dir, "application_default_credentials.json")
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            if explicit:
                raise SourceError(f"GOOGLE_APPLICATION_CREDENTIALS names {path}, which does "
                                  "not exist") from None
            return None
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot read Google credentials {path}: {e}") from None
        if not isinstance(doc, dict):
            raise SourceError(f"{path}: not a Google credentials file")
        return path, doc

    async def _refresh_user(self, path: str, doc: dict) -> tuple[str, float, str]:
        """A user's refresh token traded at the file's `token_uri` (google-auth always uses
        Google's own endpoint for these; ours honours the file), on the loop."""
        try:
            form = {"grant_type": "refresh_token", "client_id": doc["client_id"],
                    "client_secret": doc["client_secret"], "refresh_token": doc["refresh_token"]}
        except KeyError as e:
            raise SourceError(f"{path}: authorized_user credentials without {e}") from None
        uri = doc.get("token_uri") or DEFAULT_TOKEN_URI
        try:
            resp = await self._client.post(uri, data=form)
        except httpx.HTTPError as e:
            raise SourceError(f"cannot reach the Google token endpoint {uri}: {e}") from None
        return self._parse_token(resp, f"the token endpoint {uri}",
                                 f"user credentials from {path}")

    async def _metadata(self) -> tuple[str | None, float | None, str]:
        host = self._env.get("GCE_METADATA_HOST") or "metadata.google.internal"
        url = f"http://{host}{METADATA_PATH}"
        try:
            resp = await self._client.get(url, headers={"Metadata-Flavor": "Google"},
                                          timeout=3.0)
        except httpx.HTTPError:
            return None, None, "no Google credentials found: unsigned requests"
        if resp.status_code == 404:
            return None, None, "no service account on the metadata server: unsigned requests"
        return self._parse_token(resp, f"the metadata server {host}",
                                 f"the metadata server {host}")

    @staticmethod
    def _parse_token(resp: httpx.Response, where: str, method: str) -> tuple[str, float, str]:
        try:
            doc = resp.json()
        except ValueError:
            doc = {}
        if resp.status_code != 200 or not isinstance(doc, dict) or "access_token" not in doc:
            reason = doc.get("error", "") if isinstance(doc, dict) else ""
            raise SourceError(f"{where} refused to issue a token (HTTP {resp.status_code}"
                              f"{' ' + reason if reason else ''})")
        return str(doc["access_token"]), float(doc.get("expires_in") or 3600), method


def describe_file(path: str, doc: dict) -> str:
    """Names the credentials of a file for the log and `stats` (never a secret)."""
    kind = doc.get("type")
    if kind == "authorized_user":
        return f"user credentials from {path}"
    if kind == "service_account":
        return f"service account {doc.get('client_email', '?')} (key from {path})"
    if kind == "external_account":
        return f"workload identity federation ({doc.get('audience', '?')}) from {path}"
    if kind == "impersonated_service_account":
        target = str(doc.get("service_account_impersonation_url", "?")).rsplit("/", 1)[-1]
        return f"impersonated service account {target.split(':')[0]} from {path}"
    return f"{kind} credentials from {path}"


def credentials_from(doc: dict) -> Any:
    """google-auth's credentials for a parsed credentials file, scoped to read-only storage
    (each kind's own constructor: the generic loader also looks the project up, a request
    of its own). ValueError: a kind gs:// does not take."""
    scopes = [READ_ONLY_SCOPE]
    kind = doc.get("type")
    if kind == "service_account":
        from google.oauth2 import service_account
        return service_account.Credentials.from_service_account_info(doc, scopes=scopes)
    if kind == "external_account":
        source = doc.get("credential_source") or {}
        if str(source.get("environment_id", "")).startswith("aws"):
            from google.auth import aws
            return aws.Credentials.from_info(doc, scopes=scopes)
        if "executable" in source:
            from google.auth import pluggable
            return pluggable.Credentials.from_info(doc, scopes=scopes)
        from google.auth import identity_pool
        return identity_pool.Credentials.from_info(doc, scopes=scopes)
    if kind == "impersonated_service_account":
        from google.auth import impersonated_credentials
        return impersonated_credentials.Credentials.from_impersonated_service_account_info(
            doc, scopes=scopes)
    if kind == "external_account_authorized_user":
        from google.auth import external_account_authorized_user
        return external_account_authorized_user.Credentials.from_info(doc)
    raise ValueError("not a kind gs:// takes (authorized_user, service_account, "
                     "external_account, impersonated_service_account, "
                     "external_account_authorized_user)")


def token_from_file(path: str, doc: dict) -> tuple[str, float | None]:
    """An access token for the credentials file `path` (parsed: `doc`) of any kind but a
    user's, and its lifetime in seconds (None: unknown), by google-auth. Blocking: run it in a
    thread."""
    import google.auth.exceptions
    import google.auth.transport.urllib3
    import urllib3

    kind = doc.get("type")
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=FILE_TIMEOUT_S,
                                                       read=FILE_TIMEOUT_S), retries=False)
    try:
        creds = credentials_from(doc)
        creds.refresh(google.auth.transport.urllib3.Request(http))
    except (google.auth.exceptions.GoogleAuthError, ValueError, KeyError) as e:
        raise SourceError(f"{path}: no token for Google credentials of type {kind!r}: "
                          f"{e}") from None
    finally:
        http.clear()
    if not creds.token:
        raise SourceError(f"{path}: Google credentials of type {kind!r} gave no token")
    if creds.expiry is None:
        return creds.token, None
    expiry = creds.expiry.replace(tzinfo=datetime.UTC)
    return creds.token, (expiry - datetime.datetime.now(datetime.UTC)).total_seconds()


class GsSource(S3Source):
    """Objects in Google Cloud Storage buckets, through the XML API."""

    scheme = "gs"

    def __init__(self, settings: SourceSettings | None = None, *,
                 env: Mapping[str, str] | None = None,
                 budget: RequestBudget | None = None) -> None:
        env = os.environ if env is None else env
        settings = settings or SourceSettings()
        super().__init__(settings, config=load_gs_config(settings, env), budget=budget)
        self.oauth = None if self.config.credentials else GoogleToken(env, self._client,
                                                                      self.stats)
        self._bearer: str | None = None

    @property
    def credential_method(self) -> str | None:
        return "gcs-hmac" if self.oauth is None else self.oauth.method

    async def _before_attempt(self) -> None:
        await super()._before_attempt()
        if self.oauth is not None:
            self._bearer = await self.oauth.current()

    def _signed(self, url: str, bucket: str, key: str | None, query: str,
                headers: dict[str, str]) -> httpx.Request:
        request = super()._signed(url, bucket, key, query, headers)
        if self.oauth is not None and self._bearer:
            request.headers["Authorization"] = f"Bearer {self._bearer}"
        return request

    # GETs go as S3Source's do (h1.RequestHead bytes), the bearer token added last, where
    # httpx.Request's headers put it.
    def _lean_requests(self) -> bool:
        return type(self)._signed is GsSource._signed and \
            type(self)._build_request is S3Source._build_request

    def _lean_headers(self, head: RequestHead, headers: dict[str, str]) -> dict[str, str]:
        sent = super()._lean_headers(head, headers)
        if self.oauth is not None and self._bearer:
            sent = sent | {"Authorization": f"Bearer {self._bearer}"}
        return sent

    def _reauthorize(self, resp: Response, code: str) -> bool:
        if self.oauth is None:
            return super()._reauthorize(resp, code)
        if resp.status_code != 401:
            return False
        bearer = sent_headers(resp).get("authorization", "").removeprefix("Bearer ")
        return self.oauth.invalidate(bearer or None)

    def _who(self) -> str:
        if self.oauth is None:
            return super()._who()
        return f"an OAuth token from {self.oauth.method}" if self._bearer else \
            "an anonymous request (no Google credentials found)"
