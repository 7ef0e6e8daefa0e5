"""The CSI driver through kubelet's calls, with real FUSE mounts, nginx and SeaweedFS S3.

`tests/csi_node.py` has the test kubelet; the plugin and the mounter run as processes of
their own (the container-death tests are in test_csi_restart.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardfs.csi import proto
from shardfs.read.reader import ReadPolicy
from tests.conftest import Dataset, brace
from tests.csi_node import (
    DRIVER,
    csi_node,
    grpc,
    mounter_records,
    needs_root,
    node_mount_count,
)

pytestmark = needs_root

# Reads every file under ROOT and prints {relative path: sha256} as JSON: run as another
# user, or in a mount namespace of its own (a pod's view).
READER = """
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, _, files in os.walk(root):
    for name in files:
        p = os.path.join(d, name)
        with open(p, 'rb') as f:
            out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""


def checksums(ds: Dataset) -> dict[str, str]:
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in ds.files().items()}


def read_as(root: Path, *prefix: str, user: int | None = None) -> dict[str, str]:
    # The system interpreter: another user may not reach the test's virtualenv.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    result = subprocess.run([*prefix, python, "-c", READER, str(root)],
                            capture_output=True, text=True, timeout=120, user=user,
                            group=user, extra_groups=[] if user is not None else None,
                            env={"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def serve_dataset(ds: Dataset, www: Path) -> None:
    shutil.copytree(ds.shard_dir, www / "data")


def code_of(exc_info: pytest.ExceptionInfo) -> grpc.StatusCode:
    return exc_info.value.code()


def test_identity_node_info_and_two_pods_on_one_volume(dataset: Dataset, nginx,
                                                        tmp_path: Path) -> None:
    serve_dataset(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")
    want = checksums(dataset)
    with csi_node(tmp_path) as (node, kubelet):
        info = kubelet.register()
        assert info["name"] == DRIVER and info["node_id"] == "node-1" and info["version"]
        assert info["capabilities"] == [6]  # VOLUME_MOUNT_GROUP; no staging
        assert len(kubelet.call("Identity", "GetPluginCapabilities").capabilities) == 0

        # A static PV used by two pods: one daemon, one cache, the bytes fetched once.
        # Two pods starting at once: kubelet publishes both in parallel; one mount serves both.
        attrs = {"source": source, "workers": "1", "prefetch": "touched"}
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(lambda pod: kubelet.publish(pod, "data", "imagenet", attrs),
                            ("pod-a", "pod-b"))
        assert node_mount_count(node) == 1 and len(mounter_records(node)) == 1
        t0 = time.monotonic()
        c = kubelet.publish("pod-c", "data", "imagenet", attrs)
        third_publish_s = time.monotonic() - t0
        assert third_publish_s < 1.0, third_publish_s  # a bind of the one mount
        assert node_mount_count(node) == 1 and len(mounter_records(node)) == 1
        dev = {m.mountpoint: m.major_minor for m in node.paths.kubelet.mounts_below()}
        assert dev[str(a)] == dev[str(b)] == dev[str(c)]  # the same FUSE connection
        kubelet.unpublish("pod-c", "data", "imagenet")
        # A non-root reader reads every byte, in each pod; the second pod's reads fetch
        # nothing: the bytes come once for the node. A pod's own mount namespace sees the
        # volume too.
        nginx.reset_log()
        assert read_as(a, user=1000) == want
        got = [r for r in nginx.access_log() if r.uri.endswith(".tar")]
        size = {s.path.name: s.size for s in dataset.shards.shards}
        whole = Counter(r.uri.rsplit("/", 1)[-1] for r in got
                        if r.bytes_sent == size[r.uri.rsplit("/", 1)[-1]])
        assert max(whole.values(), default=0) <= 1, whole  # no shard downloaded twice
        # Reads ahead of a download may fetch their member too, within the documented
        # allowance (ReadPolicy.early_member_fraction); a slow machine takes some of it.
        early = ReadPolicy().early_member_fraction
        assert sum(r.bytes_sent for r in got) <= (1 + early) * sum(size.values())
        nginx.reset_log()
        assert read_as(b, user=1000) == want
        assert read_as(b, "unshare", "--mount", "--propagation", "slave") == want
        assert [r.uri for r in nginx.access_log()] == []
        # Writes fail: the binds are read-only, and so is shardfs.
        with pytest.raises(OSError):
            (a / "new-file").write_bytes(b"x")

        # Idempotent publish; the same target with other arguments is ALREADY_EXISTS.
        kubelet.publish("pod-a", "data", "imagenet", attrs)
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-a", "data", "other-volume", attrs)
        assert code_of(exc) == grpc.StatusCode.ALREADY_EXISTS

        kubelet.unpublish("pod-a", "data", "imagenet")
        assert not a.exists()  # the plugin removed its target
        assert read_as(b) == want  # the other pod still reads
        kubelet.unpublish("pod-a", "data", "imagenet")  # again: idempotent
        kubelet.unpublish("pod-b", "data", "imagenet")
        assert not b.exists()
        assert node_mount_count(node) == 0 and mounter_records(node) == []
        assert (node.paths.cache_root).is_dir()  # released caches stay for a remount
        logs = node.logs()
        assert "Traceback" not in logs, logs


def test_every_error_code(dataset: Dataset, nginx, tmp_path: Path) -> None:
    serve_dataset(dataset, nginx.root)
    (nginx.root / "not-a-tar.tar").write_bytes(b"this is no tar archive " * 100)
    source = brace(dataset, f"{nginx.url}/data")
    with csi_node(tmp_path) as (node, kubelet):
        target = str(kubelet.target("pod-e", "v"))
        bad = {
            "volume_id": kubelet.publish_request("", target, {"source": source}),
            "target_path": kubelet.publish_request("v", "", {"source": source}),
            "capability": kubelet.publish_request("v", target, {"source": source},
                                                  capability=False),
            "source": kubelet.publish_request("v", target, {}),
            "attribute": kubelet.publish_request("v", target, {"source": source,
                                                              "cache_size": "banana"}),
            "node path": kubelet.publish_request("v", target, {"source": source,
                                                              "cache_dir": "/etc"}),
            "secret key": kubelet.publish_request("v", target, {"source": source},
                                                  secrets={"password": "x"}),
            "local path": kubelet.publish_request("v", target, {"source": "/etc/x.tar"}),
            "file url": kubelet.publish_request("v", target, {"source": "file:///x.tar"}),
        }
        for what, req in bad.items():
            with pytest.raises(grpc.RpcError) as exc:
                kubelet.call("Node", "NodePublishVolume", req)
            assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT, (what, exc.value)
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.call("Node", "NodePublishVolume", bad["attribute"])
        # The config's own message names the key, the value and what is allowed.
        assert "cache_size: bad value 'banana'" in exc.value.details()
        for volume_id, path in (("", target), ("v", "")):
            with pytest.raises(grpc.RpcError) as exc:
                kubelet.call("Node", "NodeUnpublishVolume",
                             proto.NodeUnpublishVolumeRequest(volume_id=volume_id,
                                                              target_path=path))
            assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT

        # A failed mount is an error whose message is the daemon's `shardfs: error:` line,
        # and leaves nothing mounted, recorded or running.
        for attrs, words in (
                ({"source": "http://127.0.0.1:9/none-{0..1}.tar", "deadline": "2",
                  "timeout": "1"}, "127.0.0.1:9"),
                ({"source": f"{nginx.url}/not-a-tar.tar"}, "not-a-tar.tar")):
            with pytest.raises(grpc.RpcError) as exc:
                kubelet.publish("pod-e", "v", "v", attrs)
            assert code_of(exc) == grpc.StatusCode.INTERNAL
            assert exc.value.details().startswith("shardfs: error:"), exc.value.details()
            assert words in exc.value.details()
            assert node_mount_count(node) == 0 and mounter_records(node) == []
        # Unpublishing what was never published is fine (idempotent).
        kubelet.unpublish("pod-e", "v", "v")
        # No mounter: UNAVAILABLE (kubelet retries), and nothing left mounted.
        node.mounter.kill()
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-e", "v", "v", {"source": source})
        assert code_of(exc) == grpc.StatusCode.UNAVAILABLE, exc.value
        assert "mounter" in exc.value.details()
        assert node_mount_count(node) == 0
        assert "Traceback" not in node.logs(), node.logs()


def tar_of(members: dict[str, bytes], mode: int = 0o644) -> bytes:
    """A ustar archive of `members` (name -> bytes), each with `mode`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_gs_volume_with_a_service_account_key_in_its_secret(tmp_path: Path) -> None:
    """`GOOGLE_CREDENTIALS_JSON` in a volume's secret (a service-account key's JSON): the
    mounter writes it to a private file that GOOGLE_APPLICATION_CREDENTIALS names to the
    volume's daemon, whose gs:// source signs a JWT with the key (the stand-in token endpoint
    checks its signature); the key is in no log and in no file others may read, and gone
    with the volume. A secret that is not a credentials file is refused."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tests.cloud_standins import serve
    from tests.test_hf_gs import Gcs

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    email = "csi-reader@proj.iam.gserviceaccount.com"
    gcs = Gcs(service_account=(email, key.public_key()))
    members = {f"cls/{i}.bin": os.urandom(2000 + i) for i in range(12)}
    gcs.objects["b1/csi/train-0.tar"] = tar_of(members)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    with serve(gcs.route) as server, csi_node(tmp_path / "node") as (node, kubelet):
        document = {"type": "service_account", "project_id": "proj", "private_key_id": "k1",
                    "private_key": pem, "client_email": email, "client_id": "1",
                    "token_uri": server.url + "/token"}
        attrs = {"source": "gs://b1/csi/train-0.tar", "gs_endpoint": server.url,
                 "deadline": "5"}
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-g", "vol", "csi-gs0", attrs,
                            secrets={"GOOGLE_CREDENTIALS_JSON": "not json"})
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
        target = kubelet.publish("pod-g", "vol", "csi-gs1", attrs,
                                 secrets={"GOOGLE_CREDENTIALS_JSON": json.dumps(document)})
        assert read_as(target) == {n: hashlib.sha256(d).hexdigest()
                                   for n, d in members.items()}
        assert gcs.grants and gcs.refused == 0
        secret = key.private_bytes(serialization.Encoding.DER,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
        private = pem.splitlines()[5]  # a line of the key's base64
        assert private not in node.logs()
        held = [p for p in node.paths.mounter_state.rglob("*")
                if p.is_file() and private.encode() in p.read_bytes()]
        assert held, "the mounter keeps the key for its daemons"
        for root in (node.paths.mounter_state, node.paths.cache_root, node.paths.plugin_state):
            for path in root.rglob("*"):
                if path.is_file() and (private.encode() in path.read_bytes()
                                       or secret in path.read_bytes()):
                    assert path.stat().st_mode & 0o077 == 0, path
                    assert path.parent.stat().st_mode & 0o077 == 0, path.parent
        kubelet.unpublish("pod-g", "vol", "csi-gs1")
        assert node_mount_count(node) == 0
        assert not any(private.encode() in p.read_bytes()
                       for p in node.paths.mounter_state.rglob("*") if p.is_file())


def test_signed_url_token_in_a_volumes_secret(dataset: Dataset, nginx, tmp_path: Path) -> None:
    """`SHARDFS_URL_QUERY` in a volume's secret (an Azure SAS, say): the PV's `source` stays
    free of it, every request of the volume's daemon carries it, and no log shows it."""
    serve_dataset(dataset, nginx.root)
    token = "sv=2024-11-04&sr=c&sp=rl&sig=CsIsEcReTsIgNaTuRe%3D"
    with csi_node(tmp_path) as (node, kubelet):
        nginx.reset_log()
        target = kubelet.publish("pod-s", "data", "signed",
                                 {"source": brace(dataset, f"{nginx.url}/data")},
                                 secrets={"SHARDFS_URL_QUERY": token})
        assert read_as(target) == checksums(dataset)
        records = nginx.access_log()
        assert records and all(r.uri.endswith("?" + token) for r in records), \
            [r.uri for r in records][:3]
        daemon_logs = "".join(p.read_text(errors="replace")
                              for p in node.paths.cache_root.rglob("shardfs.log"))
        assert daemon_logs and "CsIsEcReT" not in node.logs() + daemon_logs
        kubelet.unpublish("pod-s", "data", "signed")


def test_inline_volume_with_secrets_and_fsgroup(tmp_path: Path) -> None:
    from tests.seaweed_fixture import SeaweedServer

    key, secret = "CSIKEY0000000001", "csi-secret-value-42"
    with SeaweedServer(tmp_path / "weed", {"r": (key, secret, ["Read", "List"])}) as weed, \
            csi_node(tmp_path / "node") as (node, kubelet):
        weed.admin.create_bucket(Bucket="csi-data")
        members = {f"cls/{i}.bin": os.urandom(3000 + i) for i in range(20)}
        # Not readable by others in the tar: shardfs shows 0444.
        weed.admin.put_object(Bucket="csi-data", Key="train-0.tar",
                              Body=tar_of(members, mode=0o600))
        attrs = {"source": "s3://csi-data/train-0.tar", "s3_endpoint": weed.url,
                 "s3_region": "us-east-1", "s3_addressing": "path", "deadline": "5"}
        secrets = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
        # Wrong credentials: the daemon's error line, and nothing left behind.
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-s", "inline", "csi-abc", attrs, ephemeral=True,
                            secrets={**secrets, "AWS_SECRET_ACCESS_KEY": "wrong"})
        assert exc.value.details().startswith("shardfs: error:"), exc.value.details()
        assert node_mount_count(node) == 0
        # An inline (ephemeral) volume comes as SINGLE_NODE_WRITER: mounted read-only anyway;
        # the pod's fsGroup is the files' group.
        target = kubelet.publish("pod-s", "inline", "csi-abc", attrs, ephemeral=True,
                                 secrets=secrets, fs_group="4321")
        assert os.stat(target / "cls" / "0.bin").st_gid == 4321
        got = read_as(target, user=1000)
        assert got == {n: hashlib.sha256(d).hexdigest() for n, d in members.items()}
        entry = next(m for m in node.paths.kubelet.mounts_below()
                     if m.mountpoint == str(target))
        assert "ro" in Path("/proc/self/mountinfo").read_text().split(
            f" {target} ")[1].split()[0].split(",")
        assert entry.fstype == "fuse.shardfs"
        # The secret reaches only the daemon: no log line, no file readable by others.
        assert secret not in node.logs()
        for root in (node.paths.mounter_state, node.paths.cache_root, node.paths.plugin_state):
            for path in root.rglob("*"):
                if path.is_file() and secret.encode() in path.read_bytes():
                    assert path.stat().st_mode & 0o077 == 0, path
                    assert path.parent.stat().st_mode & 0o077 == 0, path.parent
        assert not any(secret.encode() in p.read_bytes()
                       for p in node.paths.plugin_state.rglob("*") if p.is_file())
        kubelet.unpublish("pod-s", "inline", "csi-abc")
        assert node_mount_count(node) == 0
        # Released: its secrets are gone from the mounter's state too.
        assert not any(secret.encode() in p.read_bytes()
                       for p in node.paths.mounter_state.rglob("*") if p.is_file())


def test_pod_level_aws_credentials_from_the_pods_service_account_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`authentication_source: pod`: the volume's daemon assumes `aws_role_arn` with the
    pod's own service account token (kubelet's tokenRequests, STS stand-in), reads S3
    (SeaweedFS behind a gate that refuses expired keys), and takes up the newer token of a
    republish when its credentials expire. Pods of one service account share the volume, of
    another get their own. The tokens show in no log and only in 0600 files; a volume without
    a token, or without a role, is refused."""
    from tests.cloud_standins import Vendor, gate_route, serve, sts_route
    from tests.seaweed_fixture import SeaweedServer

    keys = [(f"PODKEY{i:010d}", f"pod-secret-{i}") for i in range(4)]
    vendor = Vendor(keys, lifetime=6.0)
    seen_tokens: list[str] = []
    gate_log: list[str] = []
    members = [{f"s{s}/{i}.bin": os.urandom(2500 + i) for i in range(8)} for s in range(2)]
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)  # the mounter's (and so the daemon's) environment
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    identities = {f"u{i}": (k, s, ["Read", "List"]) for i, (k, s) in enumerate(keys)}
    with SeaweedServer(tmp_path / "weed", identities) as weed, \
            serve(sts_route(vendor, seen_tokens)) as sts, \
            serve(gate_route(vendor, weed.url, gate_log)) as gate:
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts.url)
        weed.admin.create_bucket(Bucket="pods")
        for s, files in enumerate(members):
            weed.admin.put_object(Bucket="pods", Key=f"train-{s}.tar", Body=tar_of(files))
        with csi_node(tmp_path / "node") as (node, kubelet):
            attrs = {"source": "s3://pods/train-{0..1}.tar", "s3_endpoint": gate.url,
                     "s3_region": "us-east-1", "s3_addressing": "path", "deadline": "10",
                     "authentication_source": "pod", "warm_while_indexing": "false",
                     "aws_role_arn": "arn:aws:iam::123456789012:role/trainer"}
            first, second = "eyJ.first-pod-token.sig", "eyJ.second-pod-token.sig"
            for bad, why in (({}, "tokenRequests"),
                             ({"sts.amazonaws.com": ""}, "tokenRequests")):
                with pytest.raises(grpc.RpcError) as exc:
                    kubelet.publish("pod-a", "data", "pods", attrs, namespace="ml",
                                    service_account="trainer", tokens=bad)
                assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT
                assert why in exc.value.details(), exc.value.details()
            with pytest.raises(grpc.RpcError) as exc:
                kubelet.publish("pod-a", "data", "pods",
                                {k: v for k, v in attrs.items() if k != "aws_role_arn"},
                                namespace="ml", service_account="trainer",
                                tokens={"sts.amazonaws.com": first})
            assert "aws_role_arn" in exc.value.details()
            assert node_mount_count(node) == 0

            target = kubelet.publish("pod-a", "data", "pods", attrs, namespace="ml",
                                     service_account="trainer",
                                     tokens={"sts.amazonaws.com": first})
            want = {n: hashlib.sha256(d).hexdigest() for files in members
                    for n, d in files.items()}
            for name in members[0]:  # the first shard only
                assert hashlib.sha256((target / name).read_bytes()).hexdigest() == want[name]
            assert seen_tokens and set(seen_tokens) == {first}
            # Kubelet republishes (requiresRepublish) with the pod's renewed token; once the
            # role's credentials expire, the daemon assumes the role with the new one.
            kubelet.publish("pod-a", "data", "pods", attrs, namespace="ml",
                            service_account="trainer", tokens={"sts.amazonaws.com": second})
            time.sleep(vendor.lifetime + 1)
            assert read_as(target) == want  # the second shard: fetched after expiry
            assert seen_tokens[-1] == second, seen_tokens
            # Another pod of the same service account: the same volume; of another: its own.
            kubelet.publish("pod-b", "data", "pods", attrs, namespace="ml",
                            service_account="trainer", tokens={"sts.amazonaws.com": second})
            assert node_mount_count(node) == 1
            other = kubelet.publish("pod-c", "data", "pods", attrs, namespace="ml",
                                    service_account="evaluator",
                                    tokens={"sts.amazonaws.com": "eyJ.third-pod-token.sig"})
            assert node_mount_count(node) == 2 and read_as(other) == want
            logs = node.logs() + "".join(p.read_text(errors="replace")
                                         for p in node.paths.cache_root.rglob("shardfs.log"))
            for token in (first, second):
                assert token not in logs
                for root in (node.paths.mounter_state, node.paths.plugin_state):
                    for path in root.rglob("*"):
                        if path.is_file() and token.encode() in path.read_bytes():
                            assert path.stat().st_mode & 0o077 == 0, path
            for pod in ("pod-a", "pod-b", "pod-c"):
                kubelet.unpublish(pod, "data", "pods")
            assert node_mount_count(node) == 0
            assert not list(node.paths.mounter_state.rglob("*.token"))


def test_pod_level_google_credentials_by_workload_identity_federation(tmp_path: Path) -> None:
    """`authentication_source: pod` with `gcp_workload_identity_provider`: the volume's
    daemon exchanges the pod's service account token at (a stand-in of) Google's STS for the
    provider's audience, reads gs:// with the access token, and exchanges the newer token of
    a republish once the old one is refused and its access token expires. No token in any
    log; a volume with both a provider and a Google key in its secret is refused."""
    from tests.cloud_standins import serve
    from tests.test_hf_gs import Gcs

    first, second = "eyJ.gke-pod-token-1.sig", "eyJ.gke-pod-token-2.sig"
    gcs = Gcs(lifetime=4.0, subject_token=first)
    members = [{f"g{s}/{i}.bin": os.urandom(2200 + i) for i in range(6)} for s in range(2)]
    for s, files in enumerate(members):
        gcs.objects[f"b1/pods/train-{s}.tar"] = tar_of(files)
    provider = "projects/42/locations/global/workloadIdentityPools/cluster/providers/k8s"
    audience = "//iam.googleapis.com/" + provider
    with serve(gcs.route) as server, csi_node(tmp_path / "node") as (node, kubelet):
        attrs = {"source": "gs://b1/pods/train-{0..1}.tar", "gs_endpoint": server.url,
                 "deadline": "10", "warm_while_indexing": "false",
                 "authentication_source": "pod", "gcp_workload_identity_provider": provider,
                 "gcp_sts_url": server.url + "/sts"}
        token_audience = "https:" + audience  # the provider's default allowed audience
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-g", "data", "gpods", attrs, namespace="ml",
                            service_account="trainer",
                            secrets={"GOOGLE_CREDENTIALS_JSON": '{"type": "service_account"}'},
                            tokens={token_audience: first})
        assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT
        assert "use one or the other" in exc.value.details(), exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            kubelet.publish("pod-g", "data", "gpods", attrs, namespace="ml",
                            service_account="trainer", tokens={"sts.amazonaws.com": first})
        assert token_audience in exc.value.details(), exc.value.details()

        target = kubelet.publish("pod-g", "data", "gpods", attrs, namespace="ml",
                                 service_account="trainer", tokens={token_audience: first})
        want = {n: hashlib.sha256(d).hexdigest() for files in members for n, d in files.items()}
        for name in members[0]:
            assert hashlib.sha256((target / name).read_bytes()).hexdigest() == want[name]
        assert gcs.exchanged and set(gcs.exchanged) == {(audience, first)}
        # The pod's token is renewed (the old one no longer accepted); kubelet republishes.
        gcs.subject_token = second
        kubelet.publish("pod-g", "data", "gpods", attrs, namespace="ml",
                        service_account="trainer", tokens={token_audience: second})
        time.sleep(gcs.lifetime + 1)
        assert read_as(target) == want  # the second shard, after the access token expired
        assert gcs.exchanged[-1] == (audience, second), gcs.exchanged
        logs = node.logs() + "".join(p.read_text(errors="replace")
                                     for p in node.paths.cache_root.rglob("shardfs.log"))
        assert first not in logs and second not in logs
        config = next(node.paths.mounter_state.rglob("*.google.json"))
        assert config.stat().st_mode & 0o077 == 0
        assert json.loads(config.read_text())["audience"] == audience
        kubelet.unpublish("pod-g", "data", "gpods")
        assert node_mount_count(node) == 0
        assert not list(node.paths.mounter_state.rglob("*.token"))
