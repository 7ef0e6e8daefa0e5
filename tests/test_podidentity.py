"""Pod-level credentials' attributes (csi/podidentity.py), and the environment and credentials
file a volume's daemon gets from them; the whole path (kubelet's tokens, the mounter, the
daemon's exchanges) is in test_csi.py."""

from __future__ import annotations

import json

import pytest

from shardfs.csi.podidentity import PodIdentityError, parse_pod_identity, pod_token

POD = {"authentication_source": "pod", "csi.storage.k8s.io/pod.namespace": "ml",
       "csi.storage.k8s.io/serviceAccount.name": "trainer"}
POOL = "projects/42/locations/global/workloadIdentityPools/cluster/providers/k8s"
GKE = ("identitynamespace:proj.svc.id.goog:https://container.googleapis.com/v1/projects/proj/"
       "locations/us-central1/clusters/train")


def test_aws_role_and_its_environment() -> None:
    pod = parse_pod_identity({**POD, "aws_role_arn": "arn:aws:iam::1:role/r"}, {})
    assert pod is not None and pod.service_account == "ml/trainer"
    assert pod.token_audience == "sts.amazonaws.com" and pod.google_config("t") is None
    assert pod.daemon_env("/s/K.token", "/s/K.google.json") == {
        "AWS_WEB_IDENTITY_TOKEN_FILE": "/s/K.token", "AWS_ROLE_ARN": "arn:aws:iam::1:role/r",
        "AWS_ROLE_SESSION_NAME": "shardfs-ml.trainer"}


@pytest.mark.parametrize("provider,audience,token_audience", [
    (POOL, "//iam.googleapis.com/" + POOL, "https://iam.googleapis.com/" + POOL),
    ("//iam.googleapis.com/" + POOL, "//iam.googleapis.com/" + POOL,
     "https://iam.googleapis.com/" + POOL),
    (GKE, GKE, "proj.svc.id.goog"),
])
def test_google_provider_and_its_credentials_file(provider: str, audience: str,
                                                  token_audience: str) -> None:
    pod = parse_pod_identity({**POD, "gcp_workload_identity_provider": provider,
                              "gcp_service_account": "r@p.iam.gserviceaccount.com"}, {})
    assert pod is not None and pod.token_audience == token_audience
    doc = json.loads(pod.google_config("/s/K.token") or "")
    assert doc["type"] == "external_account" and doc["audience"] == audience
    assert doc["credential_source"] == {"file": "/s/K.token"}
    assert doc["token_url"] == "https://sts.googleapis.com/v1/token"
    assert doc["service_account_impersonation_url"].endswith(
        "/serviceAccounts/r@p.iam.gserviceaccount.com:generateAccessToken")
    assert pod.daemon_env("/s/K.token", "/s/K.google.json") == {
        "GOOGLE_APPLICATION_CREDENTIALS": "/s/K.google.json"}
    tokens = json.dumps({token_audience: {"token": "eyJ.t", "expirationTimestamp": "x"}})
    assert pod_token({"csi.storage.k8s.io/serviceAccount.tokens": tokens}, pod) == "eyJ.t"


@pytest.mark.parametrize("attributes,secrets,message", [
    ({"authentication_source": "node"}, {}, "expected 'driver'"),
    ({"aws_role_arn": "arn:aws:iam::1:role/r"}, {}, "used only with"),
    (POD, {}, "needs one of aws_role_arn"),
    ({**POD, "aws_role_arn": "arn:aws:iam::1:role/r", "gcp_workload_identity_provider": POOL},
     {}, "needs one of"),
    ({**POD, "aws_role_arn": "trainer"}, {}, "expected an IAM role's ARN"),
    ({**POD, "gcp_workload_identity_provider": "projects/42"}, {}, "expected projects/"),
    ({"authentication_source": "pod", "aws_role_arn": "arn:aws:iam::1:role/r"}, {},
     "podInfoOnMount"),
    ({**POD, "aws_role_arn": "arn:aws:iam::1:role/r"}, {"AWS_ACCESS_KEY_ID": "A"},
     "use one or the other"),
    ({**POD, "gcp_workload_identity_provider": POOL}, {"GS_ACCESS_KEY_ID": "A"},
     "use one or the other"),
    ({**POD, "gcp_workload_identity_provider": POOL, "gcp_sts_url": "sts"}, {},
     "expected a URL"),
])
def test_what_is_refused(attributes: dict[str, str], secrets: dict[str, str],
                         message: str) -> None:
    with pytest.raises(PodIdentityError) as exc:
        parse_pod_identity(attributes, secrets)
    assert message in str(exc.value)


def test_no_token_for_the_audience() -> None:
    pod = parse_pod_identity({**POD, "aws_role_arn": "arn:aws:iam::1:role/r"}, {})
    assert pod is not None
    for tokens in (None, "not json", json.dumps({"other": {"token": "t"}}),
                   json.dumps({"sts.amazonaws.com": {"token": ""}})):
        context = {} if tokens is None else {"csi.storage.k8s.io/serviceAccount.tokens": tokens}
        with pytest.raises(PodIdentityError) as exc:
            pod_token(context, pod)
        assert "tokenRequests: [{audience: sts.amazonaws.com}]" in str(exc.value)
    assert parse_pod_identity({"source": "s3://b/x.tar"}, {"AWS_ACCESS_KEY_ID": "A"}) is None
