"""A real nginx on 127.0.0.1 serving a directory: for tests, the demo and benchmarks.

nginx gives us what object stores give: Range requests, ETag/Last-Modified, keep-alive and
(with the echo module) a non-blocking per-request delay that mimics time to first byte.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

ECHO_MODULE = Path("/usr/lib/nginx/modules/ngx_http_echo_module.so")
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0

# Tab-separated; nginx escapes control characters inside variables, so tabs only separate.
LOG_FORMAT = (
    "'$request_method\\t$request_uri\\t$status\\t$body_bytes_sent\\t$http_range\\t$request_time'"
)


class NginxError(RuntimeError):
    """nginx could not be configured or started."""


@dataclass(frozen=True, slots=True)
class AccessRecord:
    """One line of the access log."""

    method: str
    uri: str  # as requested (percent-encoded, with query)
    status: int
    bytes_sent: int  # response body bytes actually sent
    range: str | None  # the request's Range header, if any
    request_time: float  # seconds


def free_port() -> int:
    """A port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files in `directory`), made by the openssl
    command: for an https nginx in tests and benchmarks (a client trusts it through
    SSL_CERT_FILE, as httpx does)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class Nginx:
    """nginx serving `root` at http://127.0.0.1:PORT/, all its state kept inside `workdir`."""

    def __init__(self, root: Path, workdir: Path, *, port: int = 0, latency_s: float = 0.0,
                 listings: bool = False, workers: int = 1,
                 tls: tuple[Path, Path] | None = None) -> None:
        self.root = Path(root).resolve()
        self.workdir = Path(workdir).resolve()
        self.port = port
        self.latency_s = latency_s
        self.listings = listings  # autoindex: per-file HTTP mounts (rclone) list directories
        self.workers = workers
        self.tls = tls  # (certificate, key): serve https (self_signed_certificate)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Nginx:
        if self._proc is not None:
            raise NginxError("nginx is already running")
        if self.latency_s > 0 and not ECHO_MODULE.exists():
            raise NginxError(
                f"latency_s needs the nginx echo module at {ECHO_MODULE} "
                "(apt-get install libnginx-mod-http-echo)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A port picked here can be taken before nginx binds it: try a few fresh ones.
        attempts = 3 if self.port == 0 else 1
        for attempt in range(attempts):
            port = self.port or free_port()
            try:
                self._launch(port)
            except NginxError:
                if attempt == attempts - 1 or "Address already in use" not in self._errors():
                    raise
                continue
            self.port = port
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop our own nginx (by its pid; never by name)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # fast shutdown; the master stops its workers
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # Our nginx leads its own process group (start_new_session): kill workers too.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def restart(self) -> None:
        """Stop and start again on the same port (for fault tests)."""
        self.stop()
        self.start()

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        if not self.port:
            raise NginxError("nginx has not been started")
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    # -- access log --------------------------------------------------------------------------

    @property
    def access_log_path(self) -> Path:
        return self.workdir / "access.log"

    @property
    def error_log_path(self) -> Path:
        return self.workdir / "error.log"

    def access_log(self, settle_s: float = 0.05) -> list[AccessRecord]:
        """Parsed access log. nginx logs just after the response is sent, so wait a moment."""
        if settle_s > 0:
            time.sleep(settle_s)
        try:
            text = self.access_log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        return [_parse_record(line) for line in text.splitlines() if line]

    def reset_log(self) -> None:
        """Empty the access log (nginx appends, so truncating in place is safe)."""
        if self.access_log_path.exists():
            os.truncate(self.access_log_path, 0)

    # -- internals ---------------------------------------------------------------------------

    def _launch(self, port: int) -> None:
        conf = self.workdir / "nginx.conf"
        conf.write_text(self._config(port))
        stderr_path = self.workdir / "nginx.stderr"
        for log in (self.error_log_path, stderr_path):
            log.unlink(missing_ok=True)
        with stderr_path.open("wb") as stderr:
            self._proc = subprocess.Popen(
                [
                    "nginx",
                    "-p", str(self.workdir),
                    "-e", str(self.error_log_path),
                    "-c", str(conf),
                    "-g", "daemon off;",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )  # fmt: skip
        self._wait_ready(port)

    def _wait_ready(self, port: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                raise NginxError(f"nginx exited during startup:\n{self._errors()}")
            if _port_open(port):
                return
            time.sleep(0.02)
        self.stop()
        raise NginxError(
            f"nginx did not accept connections on port {port} within "
            f"{START_TIMEOUT_S:g} s:\n{self._errors()}"
        )

    def _errors(self) -> str:
        parts = []
        for path in (self.workdir / "nginx.stderr", self.error_log_path):
            if path.exists():
                parts.append(path.read_text(errors="replace").strip())
        return "\n".join(p for p in parts if p) or "(no output)"

    # -- configuration: a subclass changes what a request is served with (S3Proxy: a proxy) --
    worker_connections = 1024
    named_location = "files"  # where a request goes after its echo_sleep

    def _serve(self) -> str:
        """The directives that answer a request (inside its location)."""
        files = f"root {self.root};"
        if self.listings:
            files += "\n            autoindex on;\n            autoindex_exact_size on;"
        return files

    def _http_settings(self) -> str:
        """http-level lines of this server's own (after the common ones)."""
        return """    default_type application/octet-stream;
    sendfile on;
    # Not "tcp_nopush on": behind echo_sleep it leaves ranged responses corked until the
    # client's delayed ACK (~30 ms more per request for httpx clients).
    tcp_nopush off;"""

    def _config(self, port: int) -> str:
        w = self.workdir
        temp_paths = "\n".join(
            f"    {kind}_temp_path {w / (kind + '_temp')};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        serve = self._serve()
        if self.latency_s > 0:
            # echo_sleep is a timer, not a blocking sleep: requests overlap like on a real store.
            # It accepts at most millisecond precision.
            sleep = f"{max(self.latency_s, 0.001):.3f}"
            locations = f"""
        location / {{
            echo_sleep {sleep};
            echo_exec @{self.named_location};
        }}
        location @{self.named_location} {{
            {serve}
        }}"""
            head = f"load_module {ECHO_MODULE};\n"
        else:
            locations = f"""
        location / {{
            {serve}
        }}"""
            head = ""
        tls = "" if self.tls is None else (
            f" ssl;\n        ssl_certificate {self.tls[0]};\n"
            f"        ssl_certificate_key {self.tls[1]}")
        # pytest's tmp dirs are 0700, so as root the worker must stay root to read them.
        user = "user root;\n" if os.geteuid() == 0 else ""
        return f"""{head}{user}worker_processes {self.workers};
pid {w / "nginx.pid"};
error_log {self.error_log_path} warn;
events {{
    worker_connections {self.worker_connections};
}}
http {{
{temp_paths}
    log_format shardfs {LOG_FORMAT};
    access_log {self.access_log_path} shardfs;
    keepalive_timeout 75s;
    keepalive_requests 100000;
    server_tokens off;
{self._http_settings()}
    server {{
        listen 127.0.0.1:{port}{tls};
        server_name localhost;{locations}
    }}
}}
"""


def _parse_record(line: str) -> AccessRecord:
    method, uri, status, sent, rng, rtime = line.split("\t")
    return AccessRecord(
        method=method,
        uri=uri,
        status=int(status),
        bytes_sent=int(sent),
        range=None if rng == "-" else rng,
        request_time=float(rtime),
    )
