"""Pod-level credentials for a volume (`authentication_source: pod`): its daemon reads the
store as the pod itself would, with the pod's own service account token.

Kubelet passes the pod's token to the driver when the CSIDriver object has `tokenRequests`
for the token's audience, and passes a fresh one at each republish (`requiresRepublish`).
The mounter keeps the latest in a 0600 file of its state dir (csi/mounter/volumes.py) and the
daemon's credential chain reads it there at each exchange:

- AWS (`aws_role_arn`): IRSA's variables, `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`:
  `AssumeRoleWithWebIdentity` (sources/credentials.py). Token audience `sts.amazonaws.com`.
- Google (`gcp_workload_identity_provider`): an `external_account` credentials file whose
  subject token is that file, exchanged at Google's STS (workload identity federation),
  optionally impersonating `gcp_service_account` (sources/gs.py). The provider is a pool's
  (`projects/N/locations/global/workloadIdentityPools/POOL/providers/P`, token audience by
  default its `https://iam.googleapis.com/...` name, which a provider allows unless told
  otherwise) or a GKE cluster's identity namespace
  (`identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/v1/projects/...
  /clusters/C`, token audience `PROJECT.svc.id.goog`, as GKE's own driver does).
  `token_audience` names another.

The volume is keyed by the pod's namespace and service account, never by its token: pods of
one service account share a daemon and a cache, pods of another get their own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

KUBELET_PREFIX = "csi.storage.k8s.io/"
POD_NAMESPACE = KUBELET_PREFIX + "pod.namespace"
SERVICE_ACCOUNT = KUBELET_PREFIX + "serviceAccount.name"
SERVICE_ACCOUNT_TOKENS = KUBELET_PREFIX + "serviceAccount.tokens"
AWS_AUDIENCE = "sts.amazonaws.com"  # the audience IRSA's tokens carry
GOOGLE_STS_URL = "https://sts.googleapis.com/v1/token"
_IAM = "//iam.googleapis.com/"

# The volume attributes read here (not daemon settings).
ATTRIBUTES = ("authentication_source", "aws_role_arn", "gcp_workload_identity_provider",
              "gcp_service_account", "gcp_sts_url", "token_audience")


class PodIdentityError(ValueError):
    """Attributes that do not make a usable pod identity, or no token from kubelet."""


@dataclass(frozen=True, slots=True)
class PodIdentity:
    service_account: str  # "NAMESPACE/NAME": whose pods share the volume
    token_audience: str  # which of kubelet's tokens is the pod's (tokenRequests)
    aws_role_arn: str | None = None
    gcp_audience: str | None = None  # //iam.googleapis.com/projects/.../providers/...
    gcp_service_account: str | None = None  # impersonated after the exchange, if given
    gcp_sts_url: str = GOOGLE_STS_URL

    @classmethod
    def from_json(cls, data: Mapping[str, str] | None) -> PodIdentity | None:
        return cls(**data) if data else None

    def daemon_env(self, token_file: str, google_file: str) -> dict[str, str]:
        """The daemon's environment for this identity, the token being in `token_file`;
        for Google, `google_file` is where the mounter writes `google_config()`."""
        if self.aws_role_arn is not None:
            name = "shardfs-" + "".join(c if c.isalnum() or c in "+=,.@-" else "."
                                        for c in self.service_account)
            return {"AWS_WEB_IDENTITY_TOKEN_FILE": token_file,
                    "AWS_ROLE_ARN": self.aws_role_arn,
                    "AWS_ROLE_SESSION_NAME": name[:64]}  # CloudTrail shows whose reads
        return {"GOOGLE_APPLICATION_CREDENTIALS": google_file}

    def google_config(self, token_file: str) -> str | None:
        """The `external_account` credentials file (as `gcloud iam workload-identity-pools
        create-cred-config` writes it) for a Google identity; None for AWS."""
        if self.gcp_audience is None:
            return None
        doc: dict[str, object] = {
            "type": "external_account", "audience": self.gcp_audience,
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": self.gcp_sts_url, "credential_source": {"file": token_file}}
        if self.gcp_service_account:
            doc["service_account_impersonation_url"] = (
                "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/"
                f"{self.gcp_service_account}:generateAccessToken")
        return json.dumps(doc)


def parse_pod_identity(context: Mapping[str, str], secrets: Mapping[str, str]
                       ) -> PodIdentity | None:
    """The volume's pod identity, or None for the driver's own credentials (the default)."""
    source = context.get("authentication_source", "driver")
    if source not in ("driver", "pod"):
        raise PodIdentityError(f"volumeAttributes: authentication_source {source!r}: "
                               "expected 'driver' (the mounter's credentials or the "
                               "secret's) or 'pod' (the pod's service account token)")
    given = [a for a in ATTRIBUTES[1:] if a in context]
    if source == "driver":
        if given:
            raise PodIdentityError(f"volumeAttributes: {', '.join(given)}: used only with "
                                   "authentication_source: pod")
        return None
    role, provider = context.get("aws_role_arn"), context.get("gcp_workload_identity_provider")
    if (role is None) == (provider is None):
        raise PodIdentityError(
            "volumeAttributes: authentication_source: pod needs one of aws_role_arn (the IAM "
            "role the pod's service account may assume, e.g. "
            "arn:aws:iam::123456789012:role/trainer) or gcp_workload_identity_provider "
            "(projects/NUMBER/locations/global/workloadIdentityPools/POOL/providers/PROVIDER)")
    namespace, account = context.get(POD_NAMESPACE), context.get(SERVICE_ACCOUNT)
    if not namespace or not account:
        raise PodIdentityError("authentication_source: pod needs the pod's namespace and "
                               "service account: set podInfoOnMount: true in the CSIDriver "
                               "object")
    who = f"{namespace}/{account}"
    if role is not None:
        if not role.startswith("arn:") or ":role/" not in role:
            raise PodIdentityError(f"volumeAttributes: aws_role_arn {role!r}: expected an IAM "
                                   "role's ARN (arn:aws:iam::ACCOUNT:role/NAME)")
        _refuse_with(secrets, "AWS_")
        return PodIdentity(who, context.get("token_audience", AWS_AUDIENCE), aws_role_arn=role)
    assert provider is not None
    if provider.startswith("identitynamespace:"):  # GKE's: the KSA token's audience is
        audience = provider                          # the namespace, PROJECT.svc.id.goog
        default_token_audience = provider.split(":")[1]
    else:
        audience = provider if provider.startswith(_IAM) else _IAM + provider.lstrip("/")
        default_token_audience = "https:" + audience
        if "/workloadIdentityPools/" not in audience or "/providers/" not in audience:
            raise PodIdentityError(f"volumeAttributes: gcp_workload_identity_provider "
                                   f"{provider!r}: expected projects/NUMBER/locations/global/"
                                   "workloadIdentityPools/POOL/providers/PROVIDER or a GKE "
                                   "identitynamespace:PROJECT.svc.id.goog:CLUSTER_URL")
    _refuse_with(secrets, "GOOGLE_", "GS_")
    sts = context.get("gcp_sts_url", GOOGLE_STS_URL)
    if not sts.startswith(("https://", "http://")):
        raise PodIdentityError(f"volumeAttributes: gcp_sts_url {sts!r}: expected a URL")
    return PodIdentity(who, context.get("token_audience", default_token_audience),
                       gcp_audience=audience,
                       gcp_service_account=context.get("gcp_service_account"),
                       gcp_sts_url=sts)


def _refuse_with(secrets: Mapping[str, str], *prefixes: str) -> None:
    mixed = sorted(k for k in secrets if k.startswith(prefixes))
    if mixed:
        raise PodIdentityError(f"authentication_source: pod and keys in the secret "
                               f"({', '.join(mixed)}): use one or the other")


def pod_token(context: Mapping[str, str], identity: PodIdentity) -> str:
    """The pod's service account token for `identity`, from kubelet's `serviceAccount.tokens`."""
    audience = identity.token_audience
    text = context.get(SERVICE_ACCOUNT_TOKENS)
    try:
        token = json.loads(text)[audience]["token"] if text else None
    except (ValueError, KeyError, TypeError):
        token = None
    if not isinstance(token, str) or not token:
        raise PodIdentityError(f"authentication_source: pod, but kubelet passed no service "
                               f"account token for audience {audience}: the CSIDriver object "
                               f"needs tokenRequests: [{{audience: {audience}}}] (and "
                               "requiresRepublish: true, so that tokens are renewed)")
    return token
