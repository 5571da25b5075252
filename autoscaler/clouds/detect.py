"""Which cloud a node runs on, found as the clouds' own SDKs find it (``notice_source = auto``).

The order, first answer wins:

1. the environment names the metadata service (``AWS_EC2_METADATA_SERVICE_ENDPOINT``, boto's
   IMDS endpoint override; ``GCE_METADATA_HOST``, google-auth's): that service, no probe;
2. the DMI vendor strings (``/sys/class/dmi/id/sys_vendor``, ``product_name``): ``Amazon...``
   -> aws, ``Google...`` -> gcp (as botocore and google-auth read them), with the metadata
   service at the link-local address;
3. a bounded probe of the link-local metadata service (``http://169.254.169.254``): AWS
   IMDSv2 (``PUT /latest/api/token`` with a TTL header answers 200 and a token), then GCE
   (``GET /computeMetadata/v1/instance/id`` with ``Metadata-Flavor: Google`` answers with
   the header ``Metadata-Flavor: Google``);
4. none: no cloud was detected, and spot notices will not be heard on this node.

The clouds' SDK opt-outs are honoured for steps 2 and 3: ``AWS_EC2_METADATA_DISABLED=true``
(botocore) takes AWS out of the search, ``NO_GCE_CHECK=true`` (google-auth) takes GCE out;
a service named in step 1 is still used. Test clusters on one host set both, so nothing
there ever searches for the real link-local service.

``decide`` is the pure decision over plain data (an environment mapping, the DMI strings,
the probe answers); ``read_dmi`` and ``probe`` are the thin IO around it and ``detect``
runs the three in order, logging one line that says what it found and how. Only the
standard library is used (``http.client``), so the watcher runs on a bare node image.
"""

from __future__ import annotations

import http.client
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moshray.autoscaler.notices.http import _validate_base_url
from moshray.autoscaler.notices.message import AWS_METADATA_URL

log = logging.getLogger(__name__)

# How a node names its metadata service: the variables the clouds' own SDKs honour (boto's
# IMDS endpoint override; google-auth's metadata host). Set by the node's setup, never by
# the job: the embedded cluster sets them to its local emulators (metadata_emulator.py).
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCP_HOST_ENV = "GCE_METADATA_HOST"
# The SDKs' opt-outs of the metadata search (botocore; google-auth).
AWS_DISABLED_ENV = "AWS_EC2_METADATA_DISABLED"
GCE_CHECK_OFF_ENV = "NO_GCE_CHECK"

LINK_LOCAL_URL = AWS_METADATA_URL  # http://169.254.169.254: both clouds serve metadata there
DMI_DIR = "/sys/class/dmi/id"
DETECTED = ("aws", "gcp", "none")
# DMI vendor strings -> cloud, as the SDKs match them (prefixes): Nitro instances say
# "Amazon EC2", GCE says "Google" / "Google Compute Engine". Older Xen-based EC2 instances
# say "Xen" and are found by the probe instead.
DMI_PREFIXES = (("Amazon", "aws"), ("Google", "gcp"))

IMDS_TOKEN_PATH = "/latest/api/token"
IMDS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
GCE_ID_PATH = "/computeMetadata/v1/instance/id"
GCE_FLAVOR = ("Metadata-Flavor", "Google")


@dataclass(frozen=True)
class Detection:
    """What ``auto`` found: ``cloud`` (aws, gcp or none), where its metadata service is
    (``metadata_url``; None for none) and ``how`` it was found, for logs and ``describe``."""

    cloud: str
    metadata_url: str | None
    how: str

    def __post_init__(self) -> None:
        if self.cloud not in DETECTED:
            raise ValueError(f"cloud must be one of {', '.join(DETECTED)}, got {self.cloud!r}")
        if (self.metadata_url is None) != (self.cloud == "none"):
            raise ValueError(f"a metadata URL goes with aws or gcp only, got {self.cloud!r} "
                             f"and {self.metadata_url!r}")

    def __str__(self) -> str:
        if self.cloud == "none":
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
    ``request_timeout_s`` bounds each probe request, ``budget_s`` the whole probe (both
    clouds). The probe's address is the caller's (``detect(base_url=...)``)."""

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


def searched_clouds(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The clouds the DMI check and the probe may find: all but those the SDK opt-outs
    (``AWS_EC2_METADATA_DISABLED=true``, ``NO_GCE_CHECK=true``) take out. Pure."""
    off = {"aws": environ.get(AWS_DISABLED_ENV, ""), "gcp": environ.get(GCE_CHECK_OFF_ENV, "")}
    return tuple(c for c in ("aws", "gcp") if off[c].strip().lower() != "true")


def dmi_cloud(dmi: Dmi) -> tuple[str, str] | None:
    """``(cloud, "DMI <field> '<value>'")`` when the DMI strings name exactly one cloud, else
    None (missing, unknown or contradicting strings). Pure."""
    found = {}
    for field in ("sys_vendor", "product_name"):
        value = (getattr(dmi, field) or "").strip()
        for prefix, cloud in DMI_PREFIXES:
            if value.startswith(prefix):
                found.setdefault(cloud, f"DMI {field} {value!r}")
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
    result is always a ``Detection``. Pure: no IO, no clock.
    """
    cloud, url = node_metadata_service(environ)
    if url is not None:
        var = AWS_ENDPOINT_ENV if cloud == "aws" else GCP_HOST_ENV
        return Detection(cloud, url, f"{var}={environ[var].strip()}")
    allowed = searched_clouds(environ)
    if not allowed:
        return Detection("none", None, f"no metadata service named, and {AWS_DISABLED_ENV} "
                                       f"and {GCE_CHECK_OFF_ENV} turn the search off")
    by_dmi = dmi_cloud(dmi)
    if by_dmi is not None and by_dmi[0] in allowed:
        return Detection(by_dmi[0], base_url.rstrip("/"), by_dmi[1])
    if probes is None:
        return None
    for answer in probes:
        if answer.found and answer.cloud in allowed:
            return Detection(answer.cloud, answer.url, answer.detail)
    tried = "; ".join(f"{a.cloud}: {a.detail}" for a in probes) or "nothing probed"
    off = [c for c in ("aws", "gcp") if c not in allowed]
    return Detection("none", None, "no cloud detected: no metadata service named in "
                     f"{AWS_ENDPOINT_ENV} / {GCP_HOST_ENV}, {_dmi_text(dmi)}, no answer at "
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


def probe(base_url: str = LINK_LOCAL_URL, clouds: tuple[str, ...] = ("aws", "gcp"), *,
          request_timeout_s: float = DetectConfig.request_timeout_s,
          budget_s: float = DetectConfig.budget_s,
          clock: Callable[[], float] = time.monotonic) -> tuple[ProbeAnswer, ...]:
    """Ask the metadata service at ``base_url`` whether it is AWS's and then GCE's (in the
    order of ``clouds``), stopping at the first that answers as its cloud.

    Bounded: every socket wait (connect, the answer) is at most ``request_timeout_s`` and at
    most what is left of ``budget_s``; a cloud not reached within the budget is answered
    "not probed". Never raises on network trouble (refused, unreachable, timeouts, garbage):
    it becomes the answer's ``detail``. Raises ``ValueError`` for a malformed ``base_url``.
    """
    base = _validate_base_url(base_url)
    parsed = urllib.parse.urlsplit(base)
    try:
        parsed.port  # a malformed port raises here, once, not inside each request
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme != "http":
        raise ValueError(f"the metadata probe speaks plain http://host[:port], got {base_url!r}")
    deadline = clock() + budget_s
    answers: list[ProbeAnswer] = []
    for cloud in clouds:
        if clock() >= deadline:
            answers.append(ProbeAnswer(cloud, base, False, "not probed: budget spent"))
            continue
        ask = _PROBES.get(cloud)
        if ask is None:
            raise ValueError(f"can probe for aws or gcp, got {cloud!r}")
        answer = ask(parsed, base, lambda: min(request_timeout_s, deadline - clock()))
        answers.append(answer)
        if answer.found:
            break
    return tuple(answers)


def _request(parsed: urllib.parse.SplitResult, method: str, path: str, headers: dict[str, str],
             left: Callable[[], float]) -> tuple[int, http.client.HTTPMessage]:
    """One request, its status and headers; each socket wait at most ``left()`` seconds."""
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


def _trouble(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:120]


def _probe_aws(parsed, base: str, left) -> ProbeAnswer:
    try:
        status, _ = _request(parsed, "PUT", IMDS_TOKEN_PATH, {IMDS_TTL_HEADER: "60"}, left)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeAnswer("aws", base, False, _trouble(exc))
    if status == 200:
        return ProbeAnswer("aws", base, True, f"IMDSv2 answered PUT {IMDS_TOKEN_PATH} with 200")
    return ProbeAnswer("aws", base, False, f"PUT {IMDS_TOKEN_PATH} -> {status}")


def _probe_gcp(parsed, base: str, left) -> ProbeAnswer:
    name, value = GCE_FLAVOR
    try:
        status, headers = _request(parsed, "GET", GCE_ID_PATH, {name: value}, left)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ProbeAnswer("gcp", base, False, _trouble(exc))
    if headers.get(name) == value:
        return ProbeAnswer("gcp", base, True, f"GCE metadata answered GET {GCE_ID_PATH} "
                                              f"({status}) with {name}: {value}")
    return ProbeAnswer("gcp", base, False, f"GET {GCE_ID_PATH} -> {status} without {name}")


_PROBES = {"aws": _probe_aws, "gcp": _probe_gcp}


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
        answers = probe(base_url, searched_clouds(environ),
                        request_timeout_s=config.request_timeout_s, budget_s=config.budget_s,
                        clock=clock)
        found = decide(environ, dmi, answers, base_url)
    if found.cloud == "none":
        log.warning("notice source: %s; spot notices will not be heard on this node", found)
    else:
        log.info("notice source: %s", found)
    return found
