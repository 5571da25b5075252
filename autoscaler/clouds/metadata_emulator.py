"""Local instance-metadata servers that speak the AWS IMDSv2 and GCE metadata protocols.

Both listen on 127.0.0.1 on a free port (threaded ``http.server``), or on a socket handed in.
The embedded cluster (``jobs/local/cluster.py``) gives each simulated spot node one: in its
loopback mode named in the node's environment as a cloud SDK would find it
(``AWS_EC2_METADATA_SERVICE_ENDPOINT`` / ``GCE_METADATA_HOST``); in its separate-hosts mode
at the real link-local address ``169.254.169.254:80`` inside the node's own network
namespace, named nowhere. It delivers spot notices through it, exactly as a cloud does; the
real notice sources in ``moshray.autoscaler.notices`` are also tested against them. They enforce what the
real services enforce, so a client that cuts a corner fails here too:

``IMDSv2Server`` (AWS)
  * ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` ->
    200 and a token; without the header or out of range -> 400; a request carrying
    ``X-Forwarded-For`` -> 403 (IMDSv2 refuses proxied token requests). ``GET`` on the token
    path -> 405; ``PUT`` anywhere else -> 405.
  * every ``GET`` needs ``X-aws-ec2-metadata-token`` holding a token that has not expired,
    else 401.
  * ``/latest/meta-data/spot/instance-action`` -> 404 until ``interrupt()``, then
    ``{"action": ..., "time": "YYYY-MM-DDTHH:MM:SSZ"}``;
    ``/latest/meta-data/events/recommendations/rebalance`` -> 404 until ``recommend_rebalance()``,
    then ``{"noticeTime": ...}``; ``/latest/meta-data/instance-id`` -> the instance id.
``GCEMetadataServer`` (GCP)
  * every request needs ``Metadata-Flavor: Google`` (else 403) and no ``X-Forwarded-For``
    (else 403); answers carry ``Metadata-Flavor: Google`` and an ``ETag``.
  * ``/computeMetadata/v1/instance/preempted`` -> ``FALSE`` until ``preempt()``, then ``TRUE``.
  * ``?wait_for_change=true``: with ``last_etag`` differing from the current ETag, answers at
    once; otherwise blocks until the value changes or ``timeout_sec`` passes (then answers the
    unchanged value). A bad ``timeout_sec`` -> 400.

Both can be told to fail the next N requests with a status (``fail_next``) and to expire
their state, and both log every request (``requests``) for assertions.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Seen:
    """One request as the server saw it."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    status: int

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def iso_utc(unix_s: float) -> str:
    """Unix seconds -> ``2026-01-01T00:02:00Z`` as AWS writes it."""
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Server:
    """A threaded HTTP server around one handler class: on 127.0.0.1:<free port>, or on
    ``listen``, a bound socket handed in (e.g. one made inside a node's network namespace
    at the real link-local address, ``jobs/local/netns.py``); the server owns and closes it."""

    def __init__(self, listen: socket.socket | None = None) -> None:
        self.lock = threading.Condition()
        self.requests: list[Seen] = []
        self._fail: list[int] = []
        self._closing = False
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _dispatch(self) -> None:
                status, body, headers = owner._answer(self)
                with owner.lock:
                    owner.requests.append(Seen(self.command, self.path,
                                               tuple(self.headers.items()), status))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _dispatch

        if listen is None:
            self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        else:
            self.httpd = ThreadingHTTPServer(listen.getsockname(), Handler,
                                             bind_and_activate=False)
            self.httpd.socket.close()
            self.httpd.socket = listen
            self.httpd.server_address = listen.getsockname()
            listen.listen(16)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True,
                                        name=type(self).__name__)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next ``n`` requests with ``status`` and an empty body."""
        with self.lock:
            self._fail.extend([status] * n)

    def _take_failure(self) -> int | None:
        with self.lock:
            return self._fail.pop(0) if self._fail else None

    def seen(self, path_prefix: str = "") -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.path.startswith(path_prefix)]

    def _answer(self, h: BaseHTTPRequestHandler) -> tuple[int, bytes, dict[str, str]]:
        raise NotImplementedError

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self.lock.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class IMDSv2Server(_Server):
    """EC2 instance metadata, IMDSv2 (session tokens required)."""

    TOKEN_PATH = "/latest/api/token"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"

    def __init__(self, instance_id: str = "i-0123456789abcdef0", clock=time.monotonic,
                 listen: socket.socket | None = None) -> None:
        self.instance_id = instance_id
        self.clock = clock
        self.tokens: dict[str, float] = {}  # token -> expiry (clock)
        self.instance_action: dict | None = None
        self.rebalance: dict | None = None
        super().__init__(listen)

    # what the test scripts ----------------------------------------------------------------

    def interrupt(self, action: str = "terminate", at_unix_s: float | None = None) -> dict:
        """Publish a spot interruption notice: ``action`` at ``at_unix_s`` (default now+120)."""
        doc = {"action": action, "time": iso_utc(at_unix_s if at_unix_s is not None
                                                    else time.time() + 120)}
        with self.lock:
            self.instance_action = doc
        return doc

    def recommend_rebalance(self, at_unix_s: float | None = None) -> dict:
        doc = {"noticeTime": iso_utc(at_unix_s if at_unix_s is not None else time.time())}
        with self.lock:
            self.rebalance = doc
        return doc

    def expire_tokens(self) -> None:
        """Every token issued so far stops working (as after its TTL)."""
        with self.lock:
            self.tokens = {t: -float("inf") for t in self.tokens}

    # protocol -------------------------------------------------------------------------------

    def _answer(self, h):
        path = urllib.parse.urlsplit(h.path).path
        if h.headers.get("X-Forwarded-For") is not None:
            return 403, b"", {}
        failure = self._take_failure()
        if failure is not None:
            return failure, b"", {}
        if path == self.TOKEN_PATH:
            if h.command != "PUT":
                return 405, b"", {}
            raw = h.headers.get(self.TTL_HEADER)
            try:
                ttl = int(raw) if raw is not None else None
            except ValueError:
                ttl = None
            if ttl is None or not 1 <= ttl <= 21600:
                return 400, b"", {}
            token = secrets.token_urlsafe(32)
            with self.lock:
                self.tokens[token] = self.clock() + ttl
            return 200, token.encode(), {self.TTL_HEADER: str(ttl), "Content-Type": "text/plain"}
        if h.command != "GET":
            return 405, b"", {}
        token = h.headers.get(self.TOKEN_HEADER)
        with self.lock:
            expiry = self.tokens.get(token) if token else None
            if expiry is None or self.clock() >= expiry:
                return 401, b"", {}
            action, rebalance = self.instance_action, self.rebalance
        if path == "/latest/meta-data/spot/instance-action":
            doc = action
        elif path == "/latest/meta-data/events/recommendations/rebalance":
            doc = rebalance
        elif path == "/latest/meta-data/instance-id":
            return 200, self.instance_id.encode(), {"Content-Type": "text/plain"}
        else:
            doc = None
        if doc is None:
            return 404, b"", {}
        return 200, json.dumps(doc).encode(), {"Content-Type": "text/plain"}


class GCEMetadataServer(_Server):
    """GCE metadata server: ``instance/preempted`` with ETags and hanging GETs."""

    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, instance_id: str = "1234567890123456789", max_wait_s: float = 30.0,
                 listen: socket.socket | None = None) -> None:
        self.instance_id = instance_id
        self.max_wait_s = max_wait_s  # cap on one hanging GET, so a test never hangs
        self.values = {self.PREEMPTED_PATH: "FALSE",
                       "/computeMetadata/v1/instance/id": instance_id,
                       "/computeMetadata/v1/instance/maintenance-event": "NONE"}
        self.versions = {path: 0 for path in self.values}
        super().__init__(listen)

    def preempt(self) -> None:
        self.set_value(self.PREEMPTED_PATH, "TRUE")

    def set_value(self, path: str, value: str) -> None:
        with self.lock:
            self.values[path] = value
            self.versions[path] = self.versions.get(path, 0) + 1
            self.lock.notify_all()

    def etag(self, path: str) -> str:
        with self.lock:
            seed = f"{path}\0{self.versions[path]}\0{self.values[path]}"
        return hashlib.sha1(seed.encode()).hexdigest()[:16]

    def _answer(self, h):
        headers = {"Metadata-Flavor": "Google", "Content-Type": "application/text"}
        if h.headers.get("X-Forwarded-For") is not None:
            return 403, b"", headers
        if h.headers.get("Metadata-Flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", headers
        failure = self._take_failure()
        if failure is not None:
            return failure, b"", headers
        if h.command != "GET":
            return 405, b"", headers
        parts = urllib.parse.urlsplit(h.path)
        path = parts.path
        if path not in self.values:
            return 404, b"", headers
        query = urllib.parse.parse_qs(parts.query)
        if query.get("wait_for_change", ["false"])[0].lower() == "true":
            try:
                timeout = float(query.get("timeout_sec", [self.max_wait_s])[0])
            except ValueError:
                return 400, b"timeout_sec must be a number", headers
            if timeout <= 0:
                return 400, b"timeout_sec must be positive", headers
            last = query.get("last_etag", [None])[0]
            end = time.monotonic() + min(timeout, self.max_wait_s)
            with self.lock:
                start_version = self.versions[path]
                if last is None or last == self.etag(path):
                    # Hang until the value changes or the timeout passes.
                    while (self.versions[path] == start_version and not self._closing
                           and time.monotonic() < end):
                        self.lock.wait(end - time.monotonic())
        with self.lock:
            value = self.values[path]
        headers["ETag"] = self.etag(path)
        return 200, value.encode(), headers
