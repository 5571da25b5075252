"""AWS spot notices: ``AWSMetadataSource`` reads EC2 instance metadata, IMDSv2 only.

``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session
token; every ``GET`` sends it in ``X-aws-ec2-metadata-token``.
``/latest/meta-data/spot/instance-action`` is 404 until the interruption notice, then
``{"action": "terminate"|"stop"|"hibernate", "time": "2026-01-01T00:02:00Z"}`` (``time`` is
when the action happens, about 2 minutes after the notice).
``/latest/meta-data/events/recommendations/rebalance`` is 404 until a rebalance
recommendation, then ``{"noticeTime": "..."}``. The token is refreshed before it expires
and once more on a 401. Follows the ``NoticeSource`` contract (``notices/message.py``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable

from moshray.autoscaler.notices.http import (
    MetadataConnection,
    _parse_utc,
    _Response,
    _TransientError,
    _validate_base_url,
)
from moshray.autoscaler.notices.message import (
    AWS_ACTIONS,
    REBALANCE,
    NoticeSource,
    PreemptionNotice,
)

AWS_METADATA_URL = "http://169.254.169.254"
AWS_NOTICE_S = 120.0  # the interruption happens two minutes after the notice
IMDS_TOKEN_TTL_MAX_S = 21600  # IMDSv2 accepts a token TTL of 1..21600 seconds

log = logging.getLogger(__name__)


class AWSMetadataSource(NoticeSource):
    """EC2 spot interruption notices and rebalance recommendations through IMDSv2.

    ``poll`` checks both documents every ``interval_s`` (AWS suggests every 5 s; the
    default 1 s is cheap and tightens the notice->drain time) until something new shows up
    or ``timeout_s`` passes. The period holds across calls: a caller polling with a shorter
    timeout (to notice its own stop sooner) does not make the checks more frequent, and a
    ``poll(0)`` before the next check is due returns None without a request. A termination
    notice is returned before a rebalance recommendation seen in the same check; each
    distinct document is returned once. Every request goes over one kept-alive connection
    (``notices/http.py``, ``MetadataConnection``), closed by the first poll after ``close``.
    """

    cloud = "aws"
    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"

    def __init__(
        self,
        node_id: str,
        base_url: str = AWS_METADATA_URL,
        *,
        pool: str = "",
        token_ttl_s: int = IMDS_TOKEN_TTL_MAX_S,
        interval_s: float = 1.0,
        request_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ):
        if not 1 <= int(token_ttl_s) <= IMDS_TOKEN_TTL_MAX_S:
            raise ValueError(f"token_ttl_s must be in 1..{IMDS_TOKEN_TTL_MAX_S}, got {token_ttl_s}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.node_id = node_id
        self.base_url = _validate_base_url(base_url)
        self.http = MetadataConnection(self.base_url)
        self.pool = pool
        self.token_ttl_s = int(token_ttl_s)
        self.interval_s = interval_s
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self.errors = 0
        self.tokens_fetched = 0
        self._token: str | None = None
        self._token_expires = 0.0  # time.monotonic() after which the token is refreshed
        self._seen: set[tuple[str, bytes]] = set()
        self._pending: list[PreemptionNotice] = []
        self._next_check = 0.0  # time.monotonic() at which the documents are due again

    def describe(self) -> str:
        return f"aws-imds {self.base_url}"

    # token ---------------------------------------------------------------------------------

    def _fresh_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        resp = self.http.request("PUT", self.TOKEN_PATH, {self.TTL_HEADER: str(self.token_ttl_s)},
                                 self.request_timeout_s)
        if resp.status != 200 or not resp.body.strip():
            raise _TransientError(f"IMDSv2 token request answered HTTP {resp.status}")
        self._token = resp.body.decode("ascii", "replace").strip()
        self.tokens_fetched += 1
        # Refresh a little before the server drops it (10% of the TTL, at most 60 s early).
        self._token_expires = (time.monotonic() + self.token_ttl_s
                               - min(60.0, 0.1 * self.token_ttl_s))
        return self._token

    def _get(self, path: str) -> _Response:
        """GET with the session token; on 401 fetch a new token and try once more."""
        for attempt in (0, 1):
            token = self._fresh_token()
            resp = self.http.request("GET", path, {self.TOKEN_HEADER: token},
                                     self.request_timeout_s)
            if resp.status != 401:
                return resp
            self._token = None  # expired or revoked
            log.info("IMDSv2 token rejected (401)%s",
                     ", fetching a new one" if attempt == 0 else "")
        raise _TransientError(f"GET {path}: HTTP 401 even with a fresh token")

    # documents -----------------------------------------------------------------------------

    def _document(self, path: str) -> dict | None:
        """The JSON document at ``path``; None while it is 404."""
        resp = self._get(path)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise _TransientError(f"GET {path}: HTTP {resp.status}")
        try:
            doc = json.loads(resp.body)
        except ValueError as e:
            raise _TransientError(f"GET {path}: body is not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise _TransientError(f"GET {path}: expected a JSON object, got {doc!r:.80}")
        return doc

    def _notice_from_action(self, doc: dict, now: float) -> PreemptionNotice:
        action = str(doc.get("action", "")).lower()
        if action not in AWS_ACTIONS:
            log.warning("unknown spot instance-action %r: treating it as terminate", action)
            action = "terminate"
        try:
            deadline = _parse_utc(str(doc["time"]))
        except (KeyError, ValueError):
            log.warning("spot instance-action without a readable time (%r): assuming %.0f s",
                        doc.get("time"), AWS_NOTICE_S)
            deadline = now + AWS_NOTICE_S
        return PreemptionNotice(self.node_id, "aws", action, deadline, now, self.describe(),
                                self.pool)

    def _check(self) -> None:
        now = self.clock()
        for path in (self.ACTION_PATH, self.REBALANCE_PATH):
            doc = self._document(path)
            if doc is None:
                continue
            key = (path, json.dumps(doc, sort_keys=True).encode())
            if key in self._seen:
                continue
            self._seen.add(key)
            if path == self.ACTION_PATH:
                self._pending.insert(0, self._notice_from_action(doc, now))
            else:
                self._pending.append(PreemptionNotice(
                    self.node_id, "aws", REBALANCE, math.inf, now, self.describe(), self.pool))

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        end = time.monotonic() + max(0.0, timeout_s)
        while not self.closed:
            if self._pending:
                return self._pending.pop(0)
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + self.interval_s
                try:
                    self._check()
                except _TransientError as e:
                    self.errors += 1
                    log.warning("AWS metadata poll failed (will retry): %s", e)
                if self._pending:
                    return self._pending.pop(0)
            now = time.monotonic()
            if now >= end:
                return None
            time.sleep(max(0.0, min(self._next_check, end) - now))
        self.http.close()  # closed: this thread owns the connection
        return None
