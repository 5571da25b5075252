"""A local GCE metadata server (``GCEMetadataServer``), for the embedded cluster and the tests
(``clouds/metadata_emulator.py`` has what every cloud's emulator shares).

It enforces what the GCE metadata server enforces:

* every request needs ``Metadata-Flavor: Google`` (else 403) and no ``X-Forwarded-For``
  (else 403); answers carry ``Metadata-Flavor: Google`` and an ``ETag``.
* ``/computeMetadata/v1/instance/preempted`` -> ``FALSE`` until ``preempt()``, then ``TRUE``.
* ``?wait_for_change=true``: with ``last_etag`` differing from the current ETag, answers at
  once; otherwise blocks until the value changes or ``timeout_sec`` passes (then answers the
  unchanged value). A bad ``timeout_sec`` -> 400.
"""

from __future__ import annotations

import hashlib
import socket
import time
import urllib.parse

from moshray.autoscaler.clouds.metadata_emulator import MetadataServer


class GCEMetadataServer(MetadataServer):
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

    def announce_preemption(self, deadline_unix_s: float) -> None:
        """``instance/preempted`` turns ``TRUE`` (GCE's signal names no time: the source
        adds its notice length, so ``deadline_unix_s`` is not used)."""
        self.preempt()

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
