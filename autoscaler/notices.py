"""Spot preemption notices: one message type and one small source interface.

A ``NoticeSource`` answers one question, "has this node been told it is going away?":
``poll(timeout_s)`` returns the next *new* ``PreemptionNotice`` (each notice is delivered
once) or None when nothing new arrived within ``timeout_s``. Sources never raise on
transient trouble (connection refused, timeouts, HTTP 5xx, a half-written body): they log
it, count it in ``errors`` and return None, so the watcher loop simply polls again.

Implementations:

* ``AWSMetadataSource``: EC2 instance metadata, IMDSv2 only. ``PUT /latest/api/token``
  with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session token; every ``GET`` sends
  it in ``X-aws-ec2-metadata-token``. ``/latest/meta-data/spot/instance-action`` is 404
  until the interruption notice, then ``{"action": "terminate"|"stop"|"hibernate",
  "time": "2026-01-01T00:02:00Z"}`` (``time`` is when the action happens, about 2 minutes
  after the notice). ``/latest/meta-data/events/recommendations/rebalance`` is 404 until a
  rebalance recommendation, then ``{"noticeTime": "..."}``. The token is refreshed before
  it expires and once more on a 401.
* ``GCPMetadataSource``: ``GET /computeMetadata/v1/instance/preempted`` with
  ``Metadata-Flavor: Google`` (the server rejects requests without it); the body is
  ``TRUE`` or ``FALSE``. It long-polls with ``?wait_for_change=true&timeout_sec=N&
  last_etag=E``: the server answers at once if the value's ETag differs from ``E``,
  otherwise when it changes or after ``N`` seconds. GCP gives about 30 s between the
  preemption signal and the hard stop, so the deadline is ``received + notice_s``.
* ``SimulatedSource``: for local clusters; ``trigger()`` / ``deliver()`` put a notice in a
  thread-safe queue that ``poll`` returns (trace replay turns a removal into one).

Only the standard library is used (``urllib``), so the watcher runs on a bare node image.
"""

from __future__ import annotations

import abc
import json
import logging
import math
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone

log = logging.getLogger(__name__)

AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"

# Actions a notice may carry. AWS names its three; "preempt" is GCP's (always a stop or
# delete chosen by the instance's termination action, invisible from inside); "rebalance"
# is AWS's early warning that the instance is at elevated risk (no deadline).
AWS_ACTIONS = ("terminate", "stop", "hibernate")
PREEMPT = "preempt"
REBALANCE = "rebalance"
ACTIONS = AWS_ACTIONS + (PREEMPT, REBALANCE)
CLOUDS = ("aws", "gcp", "simulated")

AWS_NOTICE_S = 120.0  # AWS: the interruption happens two minutes after the notice
GCP_NOTICE_S = 30.0  # GCP: ~30 s between the preemption signal and the hard stop
IMDS_TOKEN_TTL_MAX_S = 21600  # IMDSv2 accepts a token TTL of 1..21600 seconds


@dataclass(frozen=True)
class PreemptionNotice:
    """A node was told it will be taken away (or, for ``action == "rebalance"``, that it is
    at elevated risk of it).

    ``node_id`` is the Ray node id (hex) of the node the notice is about.
    ``deadline_unix_s`` is when the cloud takes the node (``math.inf`` for a rebalance
    recommendation, which carries no deadline); ``received_unix_s`` is when this node's
    source saw the notice. Both are wall-clock seconds of the noticed node, so
    ``seconds_left`` is computed there, never across machines. ``source`` names where it
    came from (e.g. ``"aws-imds http://169.254.169.254"``); ``pool`` is the capacity pool
    the node was launched from when known (see autoscaler/pools.py), else "".
    """

    node_id: str
    cloud: str
    action: str
    deadline_unix_s: float
    received_unix_s: float
    source: str
    pool: str = ""

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {CLOUDS}, got {self.cloud!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if math.isnan(self.deadline_unix_s) or not math.isfinite(self.received_unix_s):
            raise ValueError("deadline_unix_s and received_unix_s must be numbers, got "
                             f"{self.deadline_unix_s!r}, {self.received_unix_s!r}")

    @property
    def is_rebalance(self) -> bool:
        """A rebalance recommendation: a warning, not a termination."""
        return self.action == REBALANCE

    @property
    def notice_s(self) -> float:
        """Seconds of notice the cloud gave (deadline - received); inf for a rebalance."""
        return self.deadline_unix_s - self.received_unix_s

    def seconds_left(self, now_unix_s: float) -> float:
        """Seconds until the deadline at ``now_unix_s`` (never negative)."""
        return max(0.0, self.deadline_unix_s - now_unix_s)


class NoticeSource(abc.ABC):
    """Where a node learns it is being preempted.

    Contract: ``poll(timeout_s)`` returns the next notice not returned before, waiting at
    most about ``timeout_s`` seconds (``0`` = check once), else None. It never raises on
    transient errors (network, HTTP 5xx, malformed bodies): it logs, increments ``errors``
    and returns None. ``close()`` releases what the source holds; polling after it returns
    None. Not safe to poll from two threads at once (one watcher loop per source).
    """

    cloud: str = ""
    errors: int = 0

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> PreemptionNotice | None: ...

    def close(self) -> None:
        """Stop: later polls return None at once."""
        self._closed = True

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", False)

    def describe(self) -> str:
        return self.cloud


# -- HTTP plumbing shared by the metadata sources -------------------------------------------


class _TransientError(Exception):
    """A metadata request failed in a way that polling again may fix."""


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    headers: dict[str, str]


def _request(method: str, url: str, headers: dict[str, str], timeout_s: float) -> _Response:
    """One HTTP request; any status is returned, network trouble raises ``_TransientError``.

    Never follows a proxy (metadata servers are link-local; a proxy would be wrong).
    """
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=b"" if method == "PUT" else None)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return _Response(resp.status, resp.read(), {k.lower(): v for k, v in resp.headers.items()})
    except urllib.error.HTTPError as e:
        try:
            body = e.read() if e.fp is not None else b""
        except (OSError, ValueError):
            body = b""
        finally:
            e.close()
        return _Response(e.code, body, {k.lower(): v for k, v in (e.headers or {}).items()})
    except (urllib.error.URLError, OSError, socket.timeout, ValueError) as e:
        # ValueError: http.client rejects a garbled status line (e.g. a server cut off).
        raise _TransientError(f"{method} {url}: {e}") from e


def _parse_utc(text: str) -> float:
    """``2026-01-01T00:02:00Z`` (or with an offset) -> unix seconds; ValueError if not."""
    text = text.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _validate_base_url(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"metadata URL must look like http://host[:port], got {url!r}")
    return url.rstrip("/")


# -- AWS --------------------------------------------------------------------------------------


class AWSMetadataSource(NoticeSource):
    """EC2 spot interruption notices and rebalance recommendations through IMDSv2.

    ``poll`` checks both documents every ``interval_s`` (AWS suggests every 5 s; the
    default 1 s is cheap and tightens the notice->drain time) until something new shows up
    or ``timeout_s`` passes. A termination notice is returned before a rebalance
    recommendation seen in the same check; each distinct document is returned once.
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

    def describe(self) -> str:
        return f"aws-imds {self.base_url}"

    # token ---------------------------------------------------------------------------------

    def _fresh_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        resp = _request("PUT", self.base_url + self.TOKEN_PATH,
                        {self.TTL_HEADER: str(self.token_ttl_s)}, self.request_timeout_s)
        if resp.status != 200 or not resp.body.strip():
            raise _TransientError(f"IMDSv2 token request answered HTTP {resp.status}")
        self._token = resp.body.decode("ascii", "replace").strip()
        self.tokens_fetched += 1
        # Refresh a little before the server drops it (10% of the TTL, at most 60 s early).
        self._token_expires = time.monotonic() + self.token_ttl_s - min(60.0, 0.1 * self.token_ttl_s)
        return self._token

    def _get(self, path: str) -> _Response:
        """GET with the session token; on 401 fetch a new token and try once more."""
        for attempt in (0, 1):
            token = self._fresh_token()
            resp = _request("GET", self.base_url + path, {self.TOKEN_HEADER: token},
                            self.request_timeout_s)
            if resp.status != 401:
                return resp
            self._token = None  # expired or revoked
            log.info("IMDSv2 token rejected (401)%s", ", fetching a new one" if attempt == 0 else "")
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
        return PreemptionNotice(self.node_id, "aws", action, deadline, now, self.describe(), self.pool)

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
            try:
                self._check()
            except _TransientError as e:
                self.errors += 1
                log.warning("AWS metadata poll failed (will retry): %s", e)
            if self._pending:
                return self._pending.pop(0)
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self.interval_s, left))
        return None


# -- GCP --------------------------------------------------------------------------------------


class GCPMetadataSource(NoticeSource):
    """GCE preemption through the metadata server's ``instance/preempted`` value.

    The first poll reads the value and its ETag; later polls long-poll with
    ``wait_for_change=true``, ``last_etag`` and ``timeout_sec`` (whole seconds, at least 1),
    so a change is seen the moment the server flips it. ``TRUE`` becomes one notice with
    ``deadline = received + notice_s``.
    """

    cloud = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(
        self,
        node_id: str,
        base_url: str = GCP_METADATA_URL,
        *,
        pool: str = "",
        notice_s: float = GCP_NOTICE_S,
        error_backoff_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ):
        if not notice_s > 0:
            raise ValueError(f"notice_s must be positive, got {notice_s}")
        self.node_id = node_id
        self.base_url = _validate_base_url(base_url)
        self.pool = pool
        self.notice_s = float(notice_s)
        self.error_backoff_s = error_backoff_s
        self.clock = clock
        self.errors = 0
        self.etag: str | None = None
        self._read_once = False  # after the first plain read, every read is a long-poll
        self._delivered = False

    def describe(self) -> str:
        return f"gcp-metadata {self.base_url}"

    def _read(self, wait_s: int | None) -> str:
        """The current value (long-polling up to ``wait_s`` s for a change when given)."""
        url = self.base_url + self.PATH
        timeout = 5.0
        if wait_s is not None:
            query = {"wait_for_change": "true", "timeout_sec": str(wait_s)}
            if self.etag:
                query["last_etag"] = self.etag
            url += "?" + urllib.parse.urlencode(query)
            timeout += wait_s
        resp = _request("GET", url, dict(self.HEADERS), timeout)
        if resp.status != 200:
            raise _TransientError(f"GET {self.PATH}: HTTP {resp.status}")
        if resp.headers.get("metadata-flavor") != "Google":
            raise _TransientError("the answer lacks `Metadata-Flavor: Google`: not a GCE metadata server")
        self.etag = resp.headers.get("etag") or self.etag
        return resp.body.decode("ascii", "replace").strip().upper()

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        end = time.monotonic() + max(0.0, timeout_s)
        if self._delivered and not self.closed:
            time.sleep(max(0.0, timeout_s))  # nothing more can come: wait, do not spin
            return None
        first = True
        while not self.closed and not self._delivered:
            left = end - time.monotonic()
            if not first and left <= 0:
                return None
            try:
                if not self._read_once:
                    value = self._read(None)
                    self._read_once = True
                else:
                    value = self._read(max(1, int(math.ceil(left))))
            except _TransientError as e:
                self.errors += 1
                log.warning("GCP metadata poll failed (will retry): %s", e)
                time.sleep(max(0.0, min(self.error_backoff_s, end - time.monotonic())))
                first = False
                continue
            first = False
            if value == "TRUE":
                self._delivered = True
                now = self.clock()
                return PreemptionNotice(self.node_id, "gcp", PREEMPT, now + self.notice_s, now,
                                        self.describe(), self.pool)
            if value != "FALSE":
                self.errors += 1
                log.warning("instance/preempted answered %r, expected TRUE or FALSE", value[:40])
        return None


# -- simulated --------------------------------------------------------------------------------


class SimulatedSource(NoticeSource):
    """Notices delivered programmatically (local clusters, trace replay, tests).

    ``trigger(notice_s)`` builds a notice for this node due ``notice_s`` seconds from now;
    ``deliver(notice)`` queues a ready-made one. Thread-safe: any thread may deliver while
    the watcher loop polls.
    """

    cloud = "simulated"

    def __init__(self, node_id: str, *, pool: str = "", clock: Callable[[], float] = time.time):
        self.node_id = node_id
        self.pool = pool
        self.clock = clock
        self.errors = 0
        self._queue: queue.Queue[PreemptionNotice] = queue.Queue()
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "simulated"

    def trigger(self, notice_s: float, action: str = "terminate") -> PreemptionNotice:
        """Queue a notice due in ``notice_s`` seconds (``action="rebalance"``: no deadline)."""
        if not notice_s >= 0:
            raise ValueError(f"notice_s must be >= 0, got {notice_s}")
        now = self.clock()
        deadline = math.inf if action == REBALANCE else now + notice_s
        notice = PreemptionNotice(self.node_id, "simulated", action, deadline, now,
                                  self.describe(), self.pool)
        self._queue.put(notice)
        return notice

    def deliver(self, notice: PreemptionNotice) -> PreemptionNotice:
        """Queue ``notice`` (re-addressed to this node, marked as simulated)."""
        notice = replace(notice, node_id=self.node_id, cloud="simulated", source=self.describe())
        self._queue.put(notice)
        return notice

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        if self.closed:
            return None
        try:
            if timeout_s <= 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None


class SilentSource(NoticeSource):
    """A node with no notice source (``none``, or ``auto`` on a node that names no metadata
    service): polls wait and never return a notice."""

    cloud = "none"

    def __init__(self, node_id: str, *, pool: str = "", **_options):
        self.node_id, self.pool, self.errors = node_id, pool, 0
        self._closed_event = threading.Event()

    def describe(self) -> str:
        return "none"

    def close(self) -> None:
        super().close()
        self._closed_event.set()

    def poll(self, timeout_s: float) -> PreemptionNotice | None:
        self._closed_event.wait(max(0.0, timeout_s))
        return None


# How a node names its metadata service: the variables the clouds' own SDKs honour (boto's
# IMDS endpoint override; google-auth's metadata host). Set by the node's setup, never by
# the job: the embedded cluster sets them to its local emulators (metadata_emulator.py).
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCP_HOST_ENV = "GCE_METADATA_HOST"


def node_metadata_service(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """``(cloud, metadata_url)`` a node names in its environment: ``("aws", url)``,
    ``("gcp", url)``, or ``("none", None)`` when it names none. Pure."""
    aws = environ.get(AWS_ENDPOINT_ENV, "").strip()
    if aws:
        return "aws", aws.rstrip("/")
    gcp = environ.get(GCP_HOST_ENV, "").strip()
    if gcp:
        return "gcp", gcp.rstrip("/") if "://" in gcp else f"http://{gcp}"
    return "none", None


def make_source(kind: str, node_id: str, *, metadata_url: str | None = None, pool: str = "",
                **options) -> NoticeSource:
    """The source named ``kind`` ("aws", "gcp" or "simulated") for ``node_id``.

    ``metadata_url`` overrides the cloud's link-local metadata address; ``options`` go to
    the source's constructor (e.g. ``interval_s`` for AWS, ``notice_s`` for GCP).
    """
    if kind == "aws":
        return AWSMetadataSource(node_id, metadata_url or AWS_METADATA_URL, pool=pool, **options)
    if kind == "gcp":
        return GCPMetadataSource(node_id, metadata_url or GCP_METADATA_URL, pool=pool, **options)
    if kind == "none":
        return SilentSource(node_id, pool=pool)
    if kind == "simulated":
        if metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        return SimulatedSource(node_id, pool=pool, **options)
    raise ValueError(f"notice source must be aws, gcp, simulated or none, got {kind!r}")
