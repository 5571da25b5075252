"""Which cloud a node runs on, found as the clouds' own SDKs find it (``notice_source = auto``).

The clouds searched are the registered ones (``clouds/base.py``), each by its ``Identity``,
in registration order. The order, first answer wins:

1. the environment names a cloud's metadata service (its ``Identity.endpoint_env``: AWS's
   ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, boto's IMDS endpoint override; GCP's
   ``GCE_METADATA_HOST``, google-auth's): that service, no probe;
2. the DMI vendor strings (``/sys/class/dmi/id/sys_vendor``, ``product_name``) start with
   exactly one cloud's ``dmi_prefixes`` (``Amazon...`` -> aws, ``Google...`` -> gcp, as
   botocore and google-auth read them): that cloud, its metadata service at the link-local
   address;
3. a bounded probe of the link-local metadata service (``http://169.254.169.254``): each
   cloud's ``Identity.probe`` in turn (AWS: IMDSv2's token ``PUT``; GCE: ``GET
   /computeMetadata/v1/instance/id`` answered with ``Metadata-Flavor: Google``);
4. none: no cloud was detected, and spot notices will not be heard on this node.

The clouds' SDK opt-outs (``Identity.opt_out_env`` set to ``true``:
``AWS_EC2_METADATA_DISABLED``, botocore's; ``NO_GCE_CHECK``, google-auth's) take a cloud out
of steps 2 and 3; a service named in step 1 is still used. Test clusters on one host set
them all (``search_off_environ``), so nothing there ever searches for the real link-local
service.

``decide`` is the pure decision over plain data (an environment mapping, the DMI strings,
the probe answers); ``read_dmi`` and ``probe`` are the thin IO around it and ``detect``
runs the three in order, logging one line that says what it found and how.
``probe_request`` and ``describe_trouble`` are the bounded HTTP the clouds' probes share,
``metadata_get`` what their ``read_pool`` (``node_labels.py``) reads with.
Only the standard library is used (``http.client``), so the watcher runs on a bare node
image.
"""

from __future__ import annotations

import http.client
import logging
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moshray.autoscaler.clouds.base import Cloud, clouds, get_cloud
from moshray.autoscaler.notices.http import _validate_base_url

log = logging.getLogger(__name__)

LINK_LOCAL_URL = "http://169.254.169.254"  # where AWS and GCE both serve metadata
DMI_DIR = "/sys/class/dmi/id"
NONE = "none"


@dataclass(frozen=True)
class Detection:
    """What ``auto`` found: ``cloud`` (a registered cloud's name, or none), where its
    metadata service is (``metadata_url``; None for none) and ``how`` it was found, for logs
    and ``describe``."""

    cloud: str
    metadata_url: str | None
    how: str

    def __post_init__(self) -> None:
        known = (*(c.name for c in clouds()), NONE)
        if self.cloud not in known:
            raise ValueError(f"cloud must be one of {', '.join(known)}, got {self.cloud!r}")
        if (self.metadata_url is None) != (self.cloud == NONE):
            raise ValueError(f"a metadata URL goes with a cloud, not with none, got "
                             f"{self.cloud!r} and {self.metadata_url!r}")

    def __str__(self) -> str:
        if self.cloud == NONE:
            return f"none ({self.how})"
        return f"{self.cloud} ({self.how}), metadata at {self.metadata_url}"


@dataclass(frozen=True)
class Dmi:
    """The DMI vendor strings of a machine (None: the file is missing or unreadable)."""

    sys_vendor: str | None = None
    product_name: str | None = None


@dataclass(frozen=True)
class ProbeAnswer:
    """How the metadata service at ``url`` answered the probe for ``cloud``: ``found`` when
    it answered as that cloud's service does; ``detail`` says what happened, in a few words."""

    cloud: str
    url: str
    found: bool
    detail: str


@dataclass(frozen=True)
class DetectConfig:
    """Where and how long ``auto`` looks. ``dmi_dir`` holds ``sys_vendor`` / ``product_name``;
    ``request_timeout_s`` bounds each probe request, ``budget_s`` the whole probe (every
    cloud). The probe's address is the caller's (``detect(base_url=...)``)."""

    dmi_dir: str = DMI_DIR
    request_timeout_s: float = 0.75
    budget_s: float = 1.5

    def __post_init__(self) -> None:
        if not self.dmi_dir:
            raise ValueError("dmi_dir must name a directory, got ''")
        for name in ("request_timeout_s", "budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


# -- the pure decision -------------------------------------------------------------------------


def _identified() -> tuple[Cloud, ...]:
    """The registered clouds ``auto`` can find (those with an ``Identity``), in order."""
    return tuple(c for c in clouds() if c.identity is not None)


def _endpoint_url(value: str) -> str:
    """An endpoint variable's value as a base URL: ``host[:port]`` -> ``http://host[:port]``."""
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"


def node_metadata_service(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """``(cloud, metadata_url)`` a node names in its environment (the first registered cloud
    whose ``Identity.endpoint_env`` is set), or ``("none", None)`` when it names none. Pure."""
    for cloud in _identified():
        value = environ.get(cloud.identity.endpoint_env, "").strip()
        if value:
            return cloud.name, _endpoint_url(value)
    return NONE, None


def searched_clouds(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The clouds the DMI check and the probe may find: the registered clouds with an
    ``Identity`` but those whose SDK opt-out (``Identity.opt_out_env``, e.g.
    ``AWS_EC2_METADATA_DISABLED=true``, ``NO_GCE_CHECK=true``) is ``true``. Pure."""
    return tuple(c.name for c in _identified()
                 if environ.get(c.identity.opt_out_env, "").strip().lower() != "true")


def search_off_environ() -> dict[str, str]:
    """The environment that takes every registered cloud out of the search (each opt-out
    set to ``true``): what a test cluster on one host gives its nodes."""
    return {c.identity.opt_out_env: "true" for c in _identified()}


def metadata_env_names() -> tuple[str, ...]:
    """Every variable the search reads (endpoints, opt-outs), to clear from a node's
    inherited environment."""
    return tuple(name for c in _identified()
                 for name in (c.identity.endpoint_env, c.identity.opt_out_env))


def dmi_cloud(dmi: Dmi) -> tuple[str, str] | None:
    """``(cloud, "DMI <field> '<value>'")`` when the DMI strings start with exactly one
    registered cloud's ``dmi_prefixes``, else None (missing, unknown or contradicting
    strings). Pure."""
    found = {}
    for field in ("sys_vendor", "product_name"):
        value = (getattr(dmi, field) or "").strip()
        for cloud in _identified():
            if any(value.startswith(prefix) for prefix in cloud.identity.dmi_prefixes):
                found.setdefault(cloud.name, f"DMI {field} {value!r}")
    if len(found) != 1:
        return None
    ((cloud, how),) = found.items()
    return cloud, how


def decide(environ: Mapping[str, str], dmi: Dmi, probes: tuple[ProbeAnswer, ...] | None,
           base_url: str = LINK_LOCAL_URL) -> Detection | None:
    """The cloud of a node, from what it names in ``environ``, its ``dmi`` strings and the
    ``probes`` of its metadata service at ``base_url``, in that order (module docstring).

    ``probes=None`` means "not probed yet": the result is None when only a probe can decide
    (the caller probes ``searched_clouds(environ)`` and asks again). With probes given the
    result is always a ``Detection``. Pure: no IO, no clock (it reads the registry).
    """
    cloud, url = node_metadata_service(environ)
    if url is not None:
        var = get_cloud(cloud).identity.endpoint_env
        return Detection(cloud, url, f"{var}={environ[var].strip()}")
    allowed = searched_clouds(environ)
    if not allowed:
        offs = " and ".join(c.identity.opt_out_env for c in _identified()) or "no cloud"
        return Detection(NONE, None, f"no metadata service named, and {offs} "
                                     "turn the search off")
    by_dmi = dmi_cloud(dmi)
    if by_dmi is not None and by_dmi[0] in allowed:
        return Detection(by_dmi[0], base_url.rstrip("/"), by_dmi[1])
    if probes is None:
        return None
    for answer in probes:
        if answer.found and answer.cloud in allowed:
            return Detection(answer.cloud, answer.url, answer.detail)
    tried = "; ".join(f"{a.cloud}: {a.detail}" for a in probes) or "nothing probed"
    off = [c.name for c in _identified() if c.name not in allowed]
    named = " / ".join(c.identity.endpoint_env for c in _identified())
    return Detection(NONE, None, "no cloud detected: no metadata service named in "
                     f"{named}, {_dmi_text(dmi)}, no answer at "
                     f"{base_url.rstrip('/')} ({tried})"
                     + (f", {' and '.join(off)} search turned off" if off else ""))


def _dmi_text(dmi: Dmi) -> str:
    if dmi.sys_vendor is None and dmi.product_name is None:
        return "no DMI strings"
    return f"DMI sys_vendor {dmi.sys_vendor!r} product_name {dmi.product_name!r}"


# -- the IO ------------------------------------------------------------------------------------


def read_dmi(dmi_dir: str | Path = DMI_DIR) -> Dmi:
    """The DMI strings under ``dmi_dir``; a missing or unreadable file reads as None. Never
    raises (undecodable bytes are replaced)."""
    values = []
    for field in ("sys_vendor", "product_name"):
        try:
            values.append(Path(dmi_dir, field).read_text(errors="replace").strip())
        except OSError:
            values.append(None)
    return Dmi(*values)


def probe(base_url: str = LINK_LOCAL_URL, clouds: tuple[str, ...] | None = None, *,
          request_timeout_s: float = DetectConfig.request_timeout_s,
          budget_s: float = DetectConfig.budget_s,
          clock: Callable[[], float] = time.monotonic) -> tuple[ProbeAnswer, ...]:
    """Ask the metadata service at ``base_url`` whether it is each cloud's in turn (the
    order of ``clouds``; None: every registered cloud with a probe), stopping at the first
    that answers as its cloud.

    Bounded: every socket wait (connect, the answer) is at most ``request_timeout_s`` and at
    most what is left of ``budget_s``; a cloud not reached within the budget is answered
    "not probed". Never raises on network trouble (refused, unreachable, timeouts, garbage):
    it becomes the answer's ``detail``. Raises ``ValueError`` for a malformed ``base_url``
    or a cloud that is not registered or has no probe.
    """
    base = _validate_base_url(base_url)
    parsed = urllib.parse.urlsplit(base)
    try:
        parsed.port  # a malformed port raises here, once, not inside each request
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme != "http":
        raise ValueError(f"the metadata probe speaks plain http://host[:port], got {base_url!r}")
    probes = {c.name: c.identity.probe for c in _identified() if c.identity.probe is not None}
    if clouds is None:
        clouds = tuple(probes)
    for cloud in clouds:
        if cloud not in probes:
            raise ValueError(f"can probe for {', '.join(probes) or 'no cloud'}, got {cloud!r}")
    deadline = clock() + budget_s
    answers: list[ProbeAnswer] = []
    for cloud in clouds:
        if clock() >= deadline:
            answers.append(ProbeAnswer(cloud, base, False, "not probed: budget spent"))
            continue
        answer = probes[cloud](base, lambda: min(request_timeout_s, deadline - clock()))
        answers.append(answer)
        if answer.found:
            break
    return tuple(answers)


def probe_request(base: str, method: str, path: str, headers: dict[str, str],
                  left: Callable[[], float]) -> tuple[int, http.client.HTTPMessage]:
    """One plain-HTTP request to the metadata service at ``base`` (``http://host[:port]``),
    its status and headers; each socket wait at most ``left()`` seconds. Raises what the
    network raises (``OSError``, ``http.client.HTTPException``, ``TimeoutError`` when no time
    is left): a cloud's probe turns it into its answer with ``describe_trouble``."""
    parsed = urllib.parse.urlsplit(base)
    timeout = left()
    if timeout <= 0:
        raise TimeoutError("budget spent")
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.connect()
        conn.request(method, parsed.path.rstrip("/") + path, headers=headers)
        timeout = left()
        if timeout <= 0:
            raise TimeoutError("budget spent")
        conn.sock.settimeout(timeout)
        resp = conn.getresponse()
        resp.read(4096)  # small answers; the rest is not needed
        return resp.status, resp.headers
    finally:
        conn.close()


def metadata_get(url: str, headers: Mapping[str, str], timeout_s: float,
                 method: str = "GET") -> str:
    """The stripped body of one metadata request (the clouds' ``read_pool``,
    ``node_labels.py``). Raises
    OSError (unreachable, refused, an HTTP error status)."""
    request = urllib.request.Request(url, headers=dict(headers), method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read().decode().strip()


def describe_trouble(exc: BaseException) -> str:
    """A probe's network trouble in a few words (a ``ProbeAnswer.detail``)."""
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:120]


def detect(environ: Mapping[str, str], *, base_url: str = LINK_LOCAL_URL,
           config: DetectConfig = DetectConfig(),
           clock: Callable[[], float] = time.monotonic) -> Detection:
    """The cloud of this node (module docstring): ``environ`` first, then the DMI strings
    under ``config.dmi_dir``, then a probe of ``base_url`` bounded by ``config``.

    Logs one line: INFO with what was found and how, or a WARNING that no cloud was detected
    and notices will not be heard. Never raises on what it reads or probes; raises
    ``ValueError`` only for a malformed ``base_url``.
    """
    base_url = _validate_base_url(base_url)
    named = node_metadata_service(environ)[1] is not None
    dmi = Dmi() if named else read_dmi(config.dmi_dir)  # a named service needs no DMI
    found = decide(environ, dmi, None, base_url)
    if found is None:
        probed = tuple(name for name in searched_clouds(environ)
                       if get_cloud(name).identity.probe is not None)
        answers = probe(base_url, probed,
                        request_timeout_s=config.request_timeout_s, budget_s=config.budget_s,
                        clock=clock)
        found = decide(environ, dmi, answers, base_url)
    if found.cloud == NONE:
        log.warning("notice source: %s; spot notices will not be heard on this node", found)
    else:
        log.info("notice source: %s", found)
    return found
