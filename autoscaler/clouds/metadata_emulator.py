"""Local instance-metadata servers: the part every cloud's emulator shares.

``MetadataServer`` is a threaded ``http.server`` on 127.0.0.1 on a free port, or on a socket
handed in. Each cloud's protocol is a subclass in that cloud's package
(``clouds/aws/emulator.py``: ``IMDSv2Server``; ``clouds/gcp/emulator.py``:
``GCEMetadataServer``), named by the cloud's bundle (``Cloud.emulator``). The embedded
cluster (``jobs/local/cluster.py``) gives each simulated spot node one: in its loopback mode
named in the node's environment as a cloud SDK would find it (the cloud's
``Identity.endpoint_env``); in its separate-hosts mode at the real link-local address
``169.254.169.254:80`` inside the node's own network namespace, named nowhere. It delivers
spot notices through it, exactly as a cloud does; the real notice sources are also tested
against them. They enforce what the real services enforce, so a client that cuts a corner
fails here too.

Every server can be told to fail the next N requests with a status (``fail_next``), logs
every request (``requests``, ``seen``) for assertions, and announces a preemption in its
cloud's own way (``announce_preemption``), so a test or the embedded cluster can drive any
registered cloud's notice source through the same call.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-request (a node's watcher stopped with its node:
    ``ConnectionResetError``) is normal here: its traceback goes to this module's logger at
    DEBUG, not to stderr, where socketserver would print it over the user's console."""

    def handle_error(self, request, client_address) -> None:
        log.debug("metadata emulator: request from %s failed", client_address, exc_info=True)


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


class MetadataServer:
    """A threaded HTTP server around one handler class: on 127.0.0.1:<free port>, or on
    ``listen``, a bound socket handed in (e.g. one made inside a node's network namespace
    at the real link-local address, ``jobs/local/netns.py``); the server owns and closes it.

    Subclasses implement ``_answer(handler) -> (status, body, headers)`` (called on the
    server's threads; hold ``lock`` for shared state) and ``announce_preemption``."""

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
            self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        else:
            self.httpd = _QuietServer(listen.getsockname(), Handler,
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

    def announce_preemption(self, deadline_unix_s: float) -> None:
        """Publish, as the cloud does, that this instance is taken away at
        ``deadline_unix_s`` (a cloud whose notice carries no time ignores it: its source
        adds its own notice length)."""
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
