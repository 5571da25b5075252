"""A local EC2 instance-metadata server, IMDSv2 (``IMDSv2Server``), for the embedded cluster
and the tests (``clouds/metadata_emulator.py`` has what every cloud's emulator shares).

It enforces what IMDSv2 enforces:

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` ->
  200 and a token; without the header or out of range -> 400; a request carrying
  ``X-Forwarded-For`` -> 403 (IMDSv2 refuses proxied token requests). ``GET`` on the token
  path -> 405; ``PUT`` anywhere else -> 405.
* every ``GET`` needs ``X-aws-ec2-metadata-token`` holding a token that has not expired,
  else 401 (``expire_tokens`` expires them all).
* ``/latest/meta-data/spot/instance-action`` -> 404 until ``interrupt()``, then
  ``{"action": ..., "time": "YYYY-MM-DDTHH:MM:SSZ"}``;
  ``/latest/meta-data/events/recommendations/rebalance`` -> 404 until
  ``recommend_rebalance()``, then ``{"noticeTime": ...}``; ``/latest/meta-data/instance-id``
  -> the instance id.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
import urllib.parse

from moshray.autoscaler.clouds.metadata_emulator import MetadataServer, iso_utc


class IMDSv2Server(MetadataServer):
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

    def announce_preemption(self, deadline_unix_s: float) -> None:
        """A spot interruption notice: ``terminate`` at ``deadline_unix_s``."""
        self.interrupt("terminate", deadline_unix_s)

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
