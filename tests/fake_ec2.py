"""EC2 on 127.0.0.1 for provider tests: moto as a real server, with a small HTTP proxy in front.

moto has no way to make RunInstances fail for lack of capacity, and it does not honour
ClientToken idempotency, so the proxy adds exactly those two EC2 behaviours and nothing else:

* ``refuse(...)``: RunInstances for an instance type / zone / market answers with EC2's real
  error document (``<Response><Errors><Error><Code>InsufficientInstanceCapacity</Code>...``,
  HTTP 500 like EC2's server errors), as botocore parses it from AWS.
* a repeated RunInstances with a ClientToken already seen gets the first response again (what
  EC2 documents for idempotent requests) instead of launching twice.
* ``fail_action(action, code)``: every request of an action (DescribeInstances,
  DescribeSpotPriceHistory, ...) is answered with that error, e.g. a missing permission.
* ``drop_next_run_response()``: the next RunInstances reaches moto (instances are launched)
  but the connection is closed before the answer, as a timed-out request would be.

Every request passes through ``requests`` (parsed form parameters) for assertions.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import threading
import urllib.parse
import uuid
from dataclasses import dataclass

from moto.server import ThreadedMotoServer

LOOPBACK = "127.0.0.1"
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_EC2_METADATA_DISABLED": "true",
}

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    "</Errors><RequestID>{request_id}</RequestID></Response>"
)


@dataclass(frozen=True)
class Refusal:
    code: str
    instance_type: str | None = None  # None: any
    zone: str | None = None
    market: str | None = None  # "spot" | "on-demand" | None
    status: int = 500

    def matches(self, params: dict[str, str]) -> bool:
        market = "spot" if params.get("InstanceMarketOptions.MarketType") == "spot" \
            else "on-demand"
        return ((self.instance_type is None or params.get("InstanceType") == self.instance_type)
                and (self.zone is None
                     or params.get("Placement.AvailabilityZone") == self.zone)
                and (self.market is None or market == self.market))


class EC2Proxy:
    """Forwards to moto; see the module docstring for what it adds."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests: list[dict[str, str]] = []
        self._refusals: list[Refusal] = []
        self._by_token: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {}
        self._drop_next_run = False
        self._fail_actions: dict[str, Refusal] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # EC2's query API is form-encoded POSTs
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy._handle(self, body)

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._server.server_address[1]}"

    def start(self) -> EC2Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- fault controls ----
    def refuse(self, code: str = "InsufficientInstanceCapacity", *, instance_type=None,
               zone=None, market=None, status: int = 500) -> None:
        with self._lock:
            self._refusals.append(Refusal(code, instance_type, zone, market, status))

    def drop_next_run_response(self) -> None:
        with self._lock:
            self._drop_next_run = True

    def fail_describe(self, code: str | None) -> None:
        """Answer DescribeInstances with this (non-retried) error code; None to stop."""
        self.fail_action("DescribeInstances", code)

    def fail_action(self, action: str, code: str | None, status: int = 403) -> None:
        """Answer every request of ``action`` (e.g. DescribeSpotPriceHistory) with EC2's
        error document for ``code``; None to stop."""
        with self._lock:
            if code is None:
                self._fail_actions.pop(action, None)
            else:
                self._fail_actions[action] = Refusal(code, status=status)

    def clear(self) -> None:
        with self._lock:
            self._refusals.clear()
            self._by_token.clear()
            self._drop_next_run = False
            self._fail_actions.clear()
            self.requests.clear()

    def runs(self) -> list[dict[str, str]]:
        """Parameters of every RunInstances request that reached the proxy."""
        return [r for r in self.requests if r.get("Action") == "RunInstances"]

    # ---- internals ----
    def _error(self, handler, refusal: Refusal, params: dict[str, str]) -> None:
        message = (f"We currently do not have sufficient {params.get('InstanceType')} capacity "
                   f"in the Availability Zone you requested "
                   f"({params.get('Placement.AvailabilityZone', 'unknown')}).")
        if refusal.code != "InsufficientInstanceCapacity":
            message = f"{refusal.code} (injected by the test proxy)"
        payload = _ERROR_XML.format(code=refusal.code, message=message,
                                    request_id=uuid.uuid4()).encode()
        self._reply(handler, refusal.status, [("Content-Type", "text/xml")], payload)

    @staticmethod
    def _reply(handler, status: int, headers, payload: bytes) -> None:
        handler.send_response(status)
        for key, value in headers:
            if key.lower() not in ("content-length", "transfer-encoding", "connection",
                                   "server", "date"):
                handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def _forward(self, handler, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
            conn.request("POST", handler.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _handle(self, handler, body: bytes) -> None:
        params = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
        with self._lock:
            self.requests.append(params)
            action = params.get("Action")
            refusal = next((r for r in self._refusals if r.matches(params)), None) \
                if action == "RunInstances" else None
            token = params.get("ClientToken") if action == "RunInstances" else None
            replay = self._by_token.get(token) if token else None
            drop = action == "RunInstances" and self._drop_next_run and replay is None
            if drop:
                self._drop_next_run = False
            failing = self._fail_actions.get(action or "")
        if failing is not None:
            self._error(handler, failing, params)
            return
        if refusal is not None:
            self._error(handler, refusal, params)
            return
        if replay is not None:
            self._reply(handler, *replay)
            return
        status, headers, payload = self._forward(handler, body)
        if token and status == 200:
            with self._lock:
                self._by_token[token] = (status, headers, payload)
        if drop:
            handler.close_connection = True  # launched upstream, answer lost on the way
            return
        self._reply(handler, status, headers, payload)


class FakeEC2:
    """moto's ThreadedMotoServer on a free port of 127.0.0.1 plus the :class:`EC2Proxy`."""

    def __init__(self) -> None:
        self.moto = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        self.proxy: EC2Proxy | None = None

    def start(self) -> FakeEC2:
        self.moto.start()
        self.proxy = EC2Proxy(self.moto.get_host_and_port()).start()
        return self

    @property
    def moto_url(self) -> str:
        host, port = self.moto.get_host_and_port()
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.moto.stop()


@contextlib.contextmanager
def running_fake_ec2():
    """A started ``FakeEC2`` with ``FAKE_CREDENTIALS`` in the environment, for the fixtures
    that share one (module- or function-scoped); stopped and the environment restored on
    exit."""
    import pytest

    mp = pytest.MonkeyPatch()
    for key, value in FAKE_CREDENTIALS.items():
        mp.setenv(key, value)
    fake = FakeEC2().start()
    try:
        yield fake
    finally:
        fake.stop()
        mp.undo()
