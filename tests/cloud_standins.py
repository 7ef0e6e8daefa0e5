"""Loopback stand-ins for the cloud endpoints credentials come from, and a gate in front of S3.

Each behaves like the real API on the points shardfs (through botocore) depends on:
- IMDSv2: `PUT /latest/api/token` (needs the TTL header) -> token; the credential routes
  refuse requests without `X-aws-ec2-metadata-token` (401), as IMDSv2 does.
- container credentials (ECS / EKS Pod Identity): `GET <path>` needs the Authorization
  header to equal the token (from AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE).
- STS AssumeRoleWithWebIdentity: form POST, answers the STS XML document; records the
  WebIdentityToken it was given.
- SSO portal: `GET /federation/credentials?role_name=&account_id=` with
  `x-amz-sso_bearer_token`, answers `roleCredentials` (expiration in ms).
Credentials come from a `Vendor`: a rotation of key pairs the S3 server knows, each handed out
with a lifetime, and with `session_token` (empty by default: SeaweedFS accepts a session token
only from its own STS; tests against moto, which checks tokens, hand out a real one).

`S3Gate` sits between shardfs and the S3 server: it refuses a request signed with a key the
vendor says has expired (400 ExpiredToken) or was revoked (403 InvalidAccessKeyId), as S3
does, and forwards every other request unchanged (Host included, so the signature holds).
"""

from __future__ import annotations

import datetime
import http.client
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import SplitResult, parse_qs, urlsplit

Answer = tuple[int, dict[str, str], bytes]
Route = Callable[["Request"], Answer]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def query(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}


@dataclass
class Served:
    url: str
    seen: list[Request] = field(default_factory=list)


@contextmanager
def serve(route: Route) -> Iterator[Served]:
    """A threaded HTTP server on 127.0.0.1 answering every request with `route`."""
    served = Served("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            request = Request(self.command, self.path,
                              {k.lower(): v for k, v in self.headers.items()},
                              self.rfile.read(length) if length else b"")
            served.seen.append(request)
            status, headers, body = route(request)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if "content-length" not in {n.lower() for n in headers}:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_HEAD = _any

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Vendor:
    """Hands out key pairs in turn, each valid for `lifetime` seconds from issue."""

    def __init__(self, keys: list[tuple[str, str]], lifetime: float = 3600.0,
                 session_token: str = "") -> None:
        self.keys = keys
        self.lifetime = lifetime
        self.session_token = session_token
        self.issued: list[tuple[str, float]] = []  # (access key, expiry)
        self.revoked: set[str] = set()
        self._lock = threading.Lock()

    def issue(self) -> tuple[str, str, float]:
        with self._lock:
            key, secret = self.keys[len(self.issued) % len(self.keys)]
            expiry = time.time() + self.lifetime
            self.issued.append((key, expiry))
            return key, secret, expiry

    def refusal(self, key: str) -> str | None:
        """Why S3 would refuse this key now (None: it is valid)."""
        with self._lock:
            if key in self.revoked:
                return "InvalidAccessKeyId"
            expiries = [e for k, e in self.issued if k == key]
        if expiries and time.time() >= max(expiries):
            return "ExpiredToken"
        return None


def _json(doc: object, status: int = 200) -> Answer:
    return status, {"Content-Type": "application/json"}, json.dumps(doc).encode()


def imds_route(vendor: Vendor, role: str = "shardfs-node") -> Route:
    tokens: set[str] = set()

    def route(req: Request) -> Answer:
        if req.method == "PUT" and req.path == "/latest/api/token":
            if "x-aws-ec2-metadata-token-ttl-seconds" not in req.headers:
                return 400, {}, b"missing TTL"
            token = f"imds-token-{len(tokens)}"
            tokens.add(token)
            return 200, {"Content-Type": "text/plain"}, token.encode()
        if req.headers.get("x-aws-ec2-metadata-token") not in tokens:
            return 401, {}, b""  # IMDSv2 only: v1 (tokenless) requests are refused
        base = "/latest/meta-data/iam/security-credentials/"
        if req.path == base:
            return 200, {"Content-Type": "text/plain"}, role.encode()
        if req.path == base + role:
            key, secret, expiry = vendor.issue()
            return _json({"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": key,
                          "SecretAccessKey": secret, "Token": vendor.session_token,
                          "LastUpdated": iso(time.time()), "Expiration": iso(expiry)})
        return 404, {}, b""

    return route


def container_route(vendor: Vendor, path: str, token: str) -> Route:
    def route(req: Request) -> Answer:
        if req.path != path:
            return 404, {}, b""
        if req.headers.get("authorization") != token:
            return 401, {}, b"bad authorization"
        key, secret, expiry = vendor.issue()
        return _json({"AccessKeyId": key, "SecretAccessKey": secret,
                      "Token": vendor.session_token,
                      "Expiration": iso(expiry), "RoleArn": "arn:aws:iam::1:role/task"})

    return route


def sts_route(vendor: Vendor, tokens_seen: list[str]) -> Route:
    def route(req: Request) -> Answer:
        form = {k: v[0] for k, v in parse_qs(req.body.decode()).items()}
        if form.get("Action") != "AssumeRoleWithWebIdentity":
            return 400, {}, b"unsupported action"
        tokens_seen.append(form.get("WebIdentityToken", ""))
        key, secret, expiry = vendor.issue()
        xml = (
            '<AssumeRoleWithWebIdentityResponse '
            'xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleWithWebIdentityResult><Credentials>"
            f"<AccessKeyId>{key}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
            f"<SessionToken>{vendor.session_token}</SessionToken>"
            f"<Expiration>{iso(expiry)}</Expiration>"
            "</Credentials><SubjectFromWebIdentityToken>system:serviceaccount:ml:trainer"
            "</SubjectFromWebIdentityToken><AssumedRoleUser>"
            f"<Arn>{form.get('RoleArn', '')}/s</Arn><AssumedRoleId>AROA:s</AssumedRoleId>"
            "</AssumedRoleUser></AssumeRoleWithWebIdentityResult>"
            "<ResponseMetadata><RequestId>1</RequestId></ResponseMetadata>"
            "</AssumeRoleWithWebIdentityResponse>")
        return 200, {"Content-Type": "text/xml"}, xml.encode()

    return route


def sso_route(vendor: Vendor, access_token: str) -> Route:
    def route(req: Request) -> Answer:
        if not req.path.startswith("/federation/credentials"):
            return 404, {}, b""
        if req.headers.get("x-amz-sso_bearer_token") != access_token:
            return _json({"message": "Session token not found or invalid"}, 401)
        key, secret, expiry = vendor.issue()
        return _json({"roleCredentials": {"accessKeyId": key, "secretAccessKey": secret,
                                          "sessionToken": vendor.session_token,
                                          "expiration": int(expiry * 1000)}})

    return route


_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


def gate_route(vendor: Vendor, upstream: str, log: list[str]) -> Route:
    """Refuse expired/revoked keys as S3 does; forward everything else to `upstream`."""
    target = urlsplit(upstream)

    def route(req: Request) -> Answer:
        match = _CREDENTIAL.search(req.headers.get("authorization", ""))
        key = match.group(1) if match else ""
        log.append(key)
        why = vendor.refusal(key)
        if why is not None:
            status = 400 if why == "ExpiredToken" else 403
            body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{why}</Code>"
                    f"<Message>refused by the test gate</Message></Error>").encode()
            return status, {"Content-Type": "application/xml"}, body
        return _forward(req, target)

    return route


def sas_gate_route(upstream: str, accepted: set[str],
                   log: list[tuple[str, str, int]]) -> Route:
    """Azure Blob's answer to a SAS whose `sig` is not (or no longer) valid: 403
    AuthenticationFailed; requests with a signature in `accepted` (a set the test changes to
    rotate tokens) are forwarded to `upstream`. `log` gets (path, sig, status) per request."""
    target = urlsplit(upstream)

    def route(req: Request) -> Answer:
        sig = req.query.get("sig", "")
        path = urlsplit(req.path).path
        if sig not in accepted:
            log.append((path, sig, 403))
            body = (b"<?xml version='1.0' encoding='utf-8'?><Error><Code>AuthenticationFailed"
                    b"</Code><Message>Signature not valid in the specified time frame"
                    b"</Message></Error>")
            return 403, {"Content-Type": "application/xml"}, body
        answer = _forward(req, target)
        log.append((path, sig, answer[0]))
        return answer

    return route


def _forward(req: Request, target: SplitResult) -> Answer:
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    try:
        conn.putrequest(req.method, req.path, skip_host=True, skip_accept_encoding=True)
        for name, value in req.headers.items():
            if name not in ("connection", "content-length"):
                conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        body = resp.read()
        headers = {k: v for k, v in resp.getheaders()
                   if k.lower() not in ("connection", "transfer-encoding", "content-length")}
        return resp.status, headers, body
    finally:
        conn.close()
