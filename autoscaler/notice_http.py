"""HTTP plumbing shared by the metadata notice sources (``notice_aws.py``, ``notice_gcp.py``).

``_request`` makes one request and returns any HTTP status as a ``_Response``; network
trouble (refused, timed out, a garbled answer) raises ``_TransientError``, which a source
counts and polls again after. It never goes through a proxy: metadata servers are
link-local. Also ``_parse_utc`` (AWS's ISO-8601 times) and ``_validate_base_url``.
Only the standard library is used (``urllib``), so the watcher runs on a bare node image.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone


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
