"""AWS credentials for s3:// as the AWS SDKs find them, refreshed ahead of expiry.

Which credentials: botocore's default credential resolver (the reference implementation of
the AWS SDKs' chain), imported only when an s3:// source first signs a request. Its order:
environment variables (incl. AWS_SESSION_TOKEN), assume-role profiles (role_arn +
source_profile / credential_source), web identity (AWS_WEB_IDENTITY_TOKEN_FILE +
AWS_ROLE_ARN, i.e. IRSA), SSO profiles, the shared credentials file, credential_process, the
config file, container credentials (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI / _FULL_URI with
AWS_CONTAINER_AUTHORIZATION_TOKEN(_FILE): ECS and EKS Pod Identity), instance metadata
(IMDSv2, honouring AWS_EC2_METADATA_SERVICE_ENDPOINT). A named profile (AWS_PROFILE or the
mount's s3_profile) skips the environment variables, as in the SDKs.

How refresh works: botocore's own refresh runs inside `get_frozen_credentials()` (blocking
I/O, fixed 15/10-minute windows that make credentials living less than 10 minutes unusable).
So shardfs only uses botocore to *obtain* credentials, in a worker thread (with botocore's
windows set to zero on the credentials object, so that it fetches once), and keeps its own
schedule: temporary credentials are re-obtained (the whole chain is resolved again, which is
what a refresh is for every route: re-read the token file, re-run the process, re-query the
endpoint) at `expiry - min(15 min, lifetime / 2)` minus a random jitter, in the background
while requests keep signing with the current ones; only from `expiry - min(10 min,
lifetime / 4)` on do requests wait for the refresh. One refresh runs at a time. A request
refused with ExpiredToken / InvalidAccessKeyId / a 403 forces one refresh and is retried
(`invalidate`); if the fresh credentials are refused too, the error stands.

Secrets never leave this module except into the signer: logs name the provider (botocore's
`method`, e.g. `iam-role`, `container-role`, `assume-role-with-web-identity`) and the access
key id, which is not a secret.
"""

from __future__ import annotations

import datetime
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import trio

from shardfs.sources.base import SourceError, SourceStats
from shardfs.sources.sigv4 import Credentials

log = logging.getLogger(__name__)
# botocore's debug logging prints request parameters and response bodies: web identity
# tokens, secret keys, session tokens. shardfs never lets it go below info.
logging.getLogger("botocore").setLevel(logging.INFO)

ADVISORY_S = 15 * 60.0  # the AWS SDKs start refreshing this long before expiry ...
MANDATORY_S = 10 * 60.0  # ... and block requests from this long before it
RETRY_FAILED_REFRESH_S = 30.0  # a failed background refresh is tried again after this

# botocore's `method` names, in words for messages.
PROVIDERS = {
    "env": "environment variables",
    "assume-role": "an assume-role profile (role_arn)",
    "assume-role-with-web-identity": "web identity (AWS_WEB_IDENTITY_TOKEN_FILE, IRSA)",
    "sso": "AWS SSO (IAM Identity Center) profile",
    "shared-credentials-file": "the shared credentials file",
    "custom-process": "credential_process",
    "config-file": "the AWS config file",
    "container-role": "container credentials (ECS / EKS Pod Identity)",
    "iam-role": "instance metadata (IMDS, EC2 instance role)",
    "shardfs-config": "the shardfs config",
}


def describe_method(method: str) -> str:
    return f"{PROVIDERS.get(method, method)} [{method}]"


@dataclass(frozen=True, slots=True)
class _Obtained:
    """One set of credentials and when to refresh it (wall-clock seconds)."""

    credentials: Credentials | None  # None: no credentials anywhere -> unsigned requests
    method: str
    expiry: float | None  # None: long-term credentials, never refreshed on a schedule
    advise_at: float
    must_at: float
    generation: int


def _schedule(expiry: float | None, now: float) -> tuple[float, float]:
    """(refresh in the background from, block requests from) for credentials expiring then."""
    if expiry is None:
        return float("inf"), float("inf")
    lifetime = max(expiry - now, 0.0)
    lead = min(ADVISORY_S, lifetime / 2)
    must = min(MANDATORY_S, lifetime / 4)
    # Jitter: many nodes given credentials at the same moment must not refresh in lockstep.
    advise_at = expiry - lead - random.uniform(0, lead / 4)
    return advise_at, expiry - must


def _resolve(profile: str | None, region: str | None
             ) -> tuple[Credentials | None, str, float | None]:
    """Run botocore's resolver once (blocking: call it in a worker thread). `region` is the
    S3 region, also used for the STS / SSO calls some routes make (botocore reads only
    AWS_DEFAULT_REGION and the profile on its own, not AWS_REGION)."""
    import botocore.exceptions
    import botocore.session

    try:
        session = botocore.session.Session(profile=profile)
        if region and not session.get_config_variable("region"):
            session.set_config_variable("region", region)
        found = session.get_credentials()
        if found is None:
            return None, "none", None
        if hasattr(found, "_advisory_refresh_timeout"):
            # Refreshable (or deferred) credentials: shardfs schedules refreshes itself.
            # botocore's own windows (constructor arguments, no public setter) would fetch
            # credentials living less than 15 minutes a second time right here.
            found._advisory_refresh_timeout = 0
            found._mandatory_refresh_timeout = 0
        frozen = found.get_frozen_credentials()
    except botocore.exceptions.ProfileNotFound:
        raise SourceError(f"AWS profile {profile!r} not found in the AWS config or "
                          "credentials file") from None
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
        # botocore's messages (and AWS's error messages) name files, roles, providers and
        # error codes, never secrets.
        raise SourceError(f"cannot obtain AWS credentials: {e}") from None
    except Exception as e:
        # E.g. an unreadable answer from a credential endpoint: its body is not repeated.
        raise SourceError(f"cannot obtain AWS credentials: {type(e).__name__} (from the "
                          "provider's endpoint or process)") from None
    method = getattr(found, "method", None) or "unknown"
    # RefreshableCredentials keeps its expiry in `_expiry_time` (a tz-aware datetime); there
    # is no public accessor. Long-term credentials have none.
    expiry_dt = getattr(found, "_expiry_time", None)
    expiry = expiry_dt.timestamp() if isinstance(expiry_dt, datetime.datetime) else None
    creds = Credentials(frozen.access_key, frozen.secret_key, frozen.token or None,
                        source=describe_method(method))
    return creds, method, expiry


class AwsCredentials:
    """The credentials S3 requests are signed with: fixed ones, or botocore's chain."""

    def __init__(self, *, profile: str | None = None, region: str | None = None,
                 fixed: Credentials | None = None, stats: SourceStats | None = None,
                 label: str = "s3") -> None:
        self._profile = profile
        self._region = region
        self._fixed = fixed
        self._stats = stats if stats is not None else SourceStats()
        self._label = label
        self._state: _Obtained | None = None
        self._inflight: trio.Event | None = None  # set when the running refresh ends
        self._spawned = False  # a background refresh task exists
        self._force = False
        self._forced_generation = -1
        self._next_try = 0.0
        self._error: SourceError | None = None

    def adopt(self, earlier: AwsCredentials) -> None:
        """Sign with what `earlier` obtained (its event loop has ended): no new resolution
        until they are due for refresh."""
        if self._fixed is None:
            self._state = earlier._state

    @property
    def method(self) -> str | None:
        if self._fixed is not None:
            return "shardfs-config"
        return self._state.method if self._state else None

    @property
    def temporary(self) -> bool:
        """Whether the current credentials expire (and so may be refused once they do)."""
        return self._state is not None and self._state.expiry is not None

    async def current(self) -> Credentials | None:
        """The credentials to sign the next request with (None: send it unsigned)."""
        if self._fixed is not None:
            return self._fixed
        state = self._state
        now = time.time()
        due = state is None or self._force or now >= state.must_at
        if due and state is not None and not self._force and now < self._next_try:
            # The last refresh failed moments ago: sign with what we have, or report it.
            if state.expiry is not None and now >= state.expiry and self._error is not None:
                raise self._error
            due = False
        if due:
            await self._refresh()
        elif (now >= state.advise_at and now >= self._next_try and self._inflight is None
              and not self._spawned):
            self._spawned = True
            trio.lowlevel.spawn_system_task(self._background, name="s3-credential-refresh")
        assert self._state is not None
        return self._state.credentials

    def invalidate(self, access_key: str | None, token: str | None) -> bool:
        """A request signed with (access_key, token) was refused as if the key had expired
        or rotated. True: refresh (once) and retry it; False: the refusal stands."""
        state = self._state
        if self._fixed is not None or state is None or state.credentials is None:
            return False
        creds = state.credentials
        if (creds.access_key, creds.session_token) != (access_key, token):
            return True  # already refreshed since that request was signed
        if state.generation == self._forced_generation:
            return False  # these are fresh from a forced refresh: the refusal is real
        log.info("%s: credentials from %s (access key %s) were refused; refreshing them",
                 self._label, describe_method(state.method), creds.access_key)
        self._force = True
        return True

    async def _background(self) -> None:
        try:
            await self._refresh()
        except Exception as e:  # a system task must not raise; requests keep the old ones
            log.warning("%s: background credential refresh failed: %s", self._label, e)
        finally:
            self._spawned = False

    async def _refresh(self) -> None:
        """Obtain credentials again. One refresh at a time: later callers wait for the
        running one and use its result."""
        if self._inflight is not None:
            await self._inflight.wait()
            if self._state is None:
                raise self._error or SourceError("no AWS credentials could be obtained")
            if not self._force:
                return
            if self._inflight is not None:  # another caller already started the forced one
                await self._inflight.wait()
                return
        self._inflight = trio.Event()
        try:
            await self._obtain()
        finally:
            done, self._inflight = self._inflight, None
            done.set()

    async def _obtain(self) -> None:
        forced, self._force = self._force, False
        previous = self._state
        try:
            creds, method, expiry = await trio.to_thread.run_sync(
                _resolve, self._profile, self._region, abandon_on_cancel=True)
        except SourceError as e:
            self._error = e
            self._next_try = self._retry_time(previous)
            usable = (previous is not None and previous.credentials is not None
                      and (previous.expiry is None or time.time() < previous.expiry))
            if not usable:
                raise
            assert previous is not None
            log.warning("%s: refreshing credentials from %s failed, keeping the current ones "
                        "until they expire: %s", self._label, describe_method(previous.method), e)
            return
        self._error = None
        if creds is None and previous is not None and previous.credentials is not None:
            # The chain found nothing this time (a metadata endpoint blinked): keep what we
            # have rather than falling back to unsigned requests.
            self._next_try = self._retry_time(previous)
            log.warning("%s: refreshing credentials found none; keeping those from %s",
                        self._label, describe_method(previous.method))
            return
        now = time.time()
        advise_at, must_at = _schedule(expiry, now)
        generation = previous.generation + 1 if previous else 0
        self._state = _Obtained(creds, method, expiry, advise_at, must_at, generation)
        if forced:
            self._forced_generation = generation
        if previous is not None:
            self._stats.credential_refreshes += 1
        self._log(self._state, now)

    @staticmethod
    def _retry_time(previous: _Obtained | None) -> float:
        """When to try again after a failed refresh: soon enough to beat the expiry."""
        now = time.time()
        wait = RETRY_FAILED_REFRESH_S
        if previous is not None and previous.expiry is not None:
            wait = min(wait, max(1.0, (previous.expiry - now) / 4))
        return now + wait

    def _log(self, state: _Obtained, now: float) -> None:
        if state.credentials is None:
            log.info("%s: no AWS credentials found (environment, profiles, web identity, SSO, "
                     "credential_process, container, instance metadata): requests are sent "
                     "unsigned", self._label)
            return
        until = ("no expiry" if state.expiry is None else
                 f"expire in {state.expiry - now:.0f} s, refresh from "
                 f"{max(state.advise_at - now, 0):.0f} s")
        log.info("%s: using credentials from %s, access key %s (%s)", self._label,
                 describe_method(state.method), state.credentials.access_key, until)


def credentials_summary(creds: AwsCredentials | None) -> dict[str, Any]:
    """For stats: which provider, never a secret."""
    if creds is None:
        return {}
    return {"credential_provider": creds.method or "not yet resolved"}
