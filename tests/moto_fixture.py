"""moto's standalone S3 server on 127.0.0.1, as its own process, for S3Source tests.

    with MotoServer(tmp_path) as moto:
        s3 = moto.client("s3")                  # boto3, test-only, dummy credentials
        s3.create_bucket(Bucket="b"); s3.put_object(Bucket="b", Key="k", Body=b"...")
        keys = moto.iam_user("reader", ["s3:GetObject"])   # real keys moto will check
        moto.enforce_auth()                     # from now on every request is verified

With auth enforced, moto recomputes each request's SigV4 signature (with botocore, from the
request it received) and checks the IAM policy of the access key: a real, independent check
of our signer. A test using it is skipped when moto[server] or boto3 are missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from shardfs.devtools.nginx import _port_open, free_port

REGION = "us-east-1"
START_TIMEOUT_S = 30.0


class MotoServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        pytest.importorskip("boto3", reason="boto3 is a test dependency (pip install boto3)")
        pytest.importorskip("moto.server", reason="moto[server] is a test dependency "
                            "(pip install 'moto[server]')")
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        for attempt in range(3):
            self.port = free_port()
            log = (self.workdir / "moto.log").open("wb")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
            log.close()
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _port_open(self.port):
                    return self
                time.sleep(0.05)
            self.stop()
            if attempt == 2:
                text = (self.workdir / "moto.log").read_text(errors="replace")
                raise RuntimeError(f"moto_server did not start:\n{text[-2000:]}")
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop our own server, by its pid."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- test-side helpers (boto3) -------------------------------------------------------------

    def client(self, service: str, key: str = "testing", secret: str = "testing",
               token: str | None = None) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            service, endpoint_url=self.url, region_name=REGION, aws_access_key_id=key,
            aws_secret_access_key=secret, aws_session_token=token,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

    def iam_user(self, name: str, actions: list[str]) -> tuple[str, str]:
        """An IAM user allowed `actions` on every resource; returns (access key, secret)."""
        iam = self.client("iam")
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17",
                  "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def enforce_auth(self) -> None:
        """Verify the signature and IAM policy of every later request."""
        request = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0",
                                         method="POST", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
