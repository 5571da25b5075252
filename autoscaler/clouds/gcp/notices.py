"""GCP preemption notices: ``GCPMetadataSource`` reads the GCE metadata server.

``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` (the server
rejects requests without it); the body is ``TRUE`` or ``FALSE``. It long-polls with
``?wait_for_change=true&timeout_sec=N&last_etag=E``: the server answers at once if the
value's ETag differs from ``E``, otherwise when it changes or after ``N`` seconds. GCP gives
about 30 s between the preemption signal and the hard stop, so the deadline is
``received + notice_s``. Follows the ``NoticeSource`` contract (``notices/message.py``).
"""

from __future__ import annotations

import logging
import math
import time
import urllib.parse
from collections.abc import Callable

from moshray.autoscaler.notices.http import (
    MetadataConnection,
    _TransientError,
    _validate_base_url,
)
from moshray.autoscaler.notices.message import PREEMPT, NoticeSource, PreemptionNotice

GCP_METADATA_URL = "http://metadata.google.internal"
GCP_NOTICE_S = 30.0  # about 30 s between the preemption signal and the hard stop

log = logging.getLogger(__name__)


class GCPMetadataSource(NoticeSource):
    """GCE preemption through the metadata server's ``instance/preempted`` value.

    The first poll reads the value and its ETag; later polls long-poll with
    ``wait_for_change=true``, ``last_etag`` and ``timeout_sec`` (whole seconds, at least 1),
    so a change is seen the moment the server flips it. ``TRUE`` becomes one notice with
    ``deadline = received + notice_s``. Every read goes over one kept-alive connection
    (``notices/http.py``, ``MetadataConnection``), closed by the first poll after ``close``.
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
        self.http = MetadataConnection(self.base_url)
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
        url = self.PATH
        timeout = 5.0
        if wait_s is not None:
            query = {"wait_for_change": "true", "timeout_sec": str(wait_s)}
            if self.etag:
                query["last_etag"] = self.etag
            url += "?" + urllib.parse.urlencode(query)
            timeout += wait_s
        resp = self.http.request("GET", url, dict(self.HEADERS), timeout)
        if resp.status != 200:
            raise _TransientError(f"GET {self.PATH}: HTTP {resp.status}")
        if resp.headers.get("metadata-flavor") != "Google":
            raise _TransientError("the answer lacks `Metadata-Flavor: Google`: "
                                  "not a GCE metadata server")
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
                self.http.close()  # nothing more to read
                now = self.clock()
                return PreemptionNotice(self.node_id, "gcp", PREEMPT, now + self.notice_s, now,
                                        self.describe(), self.pool)
            if value != "FALSE":
                self.errors += 1
                log.warning("instance/preempted answered %r, expected TRUE or FALSE", value[:40])
        self.http.close()  # closed (or delivered): this thread owns the connection
        return None
