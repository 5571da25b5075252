"""A Compute Engine REST endpoint on 127.0.0.1: the subset the GCP provider uses.

Speaks the JSON shapes of ``compute.googleapis.com/compute/v1`` as google-cloud-compute's REST
transport expects them: instances insert / get / list / aggregatedList / delete / setLabels
and zone operations get / wait. Inserts and deletes return a RUNNING zonal operation that is
DONE on the next get or wait, as GCE's long-running operations are; ``requestId`` makes a
repeated insert return the first operation (GCE's documented idempotency); ``setLabels``
checks the label fingerprint (412 when stale).

Faults, shaped like GCE's:

* ``exhaust(zone, machine_type=None, provisioning_model=None)``: an insert there ends in an
  operation with ``error.errors[0].code = ZONE_RESOURCE_POOL_EXHAUSTED``, HTTP 503 (what GCE
  reports when a zone is out of capacity).
* ``quota(zone)``: the insert itself is refused with HTTP 403 ``quotaExceeded``.
* ``lose_next_insert_response()``: the next insert creates its VM but is answered with HTTP
  503 ``backendError``, as when GCE's front end times out after the work was done.
* ``preempt(name)``: GCE reclaims a spot VM (deleted, or TERMINATED when its termination action
  is STOP).

Every request is kept in ``requests`` (method, path, query, JSON body) for assertions.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import itertools
import json
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
BASE = "https://www.googleapis.com/compute/v1"
_ids = itertools.count(4_000_000_000_000_000_001)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: dict | None
    headers: dict[str, str] = field(default_factory=dict)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())


def _fingerprint(labels: dict) -> str:
    digest = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).digest()[:8]
    return base64.b64encode(digest).decode()


def _error(code: int, message: str, reason: str, domain: str = "global") -> dict:
    return {"error": {"code": code, "message": message,
                      "errors": [{"message": message, "domain": domain, "reason": reason}]}}


class FakeCompute:
    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.instances: dict[tuple[str, str, str], dict] = {}  # (project, zone, name)
        self.operations: dict[str, dict] = {}
        self._pending_errors: dict[str, dict] = {}
        self._by_request_id: dict[str, dict] = {}
        self._exhausted: list[tuple[str, str | None, str | None]] = []
        self._quota: set[str] = set()
        self._lose_next_insert = False
        self._next_ip = itertools.count(2)
        self._lock = threading.RLock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _do(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
                body = json.loads(raw) if raw else None
                req = Request(self.command, url.path, query, body, dict(self.headers.items()))
                status, payload = fake._route(req)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _do

        self._server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # ---- lifecycle ----
    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self._server.server_address[1]}"

    def start(self) -> FakeCompute:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self._exhausted.clear()
            self._quota.clear()
            self._lose_next_insert = False

    # ---- faults ----
    def exhaust(self, zone: str, machine_type: str | None = None,
                provisioning_model: str | None = None) -> None:
        with self._lock:
            self._exhausted.append((zone, machine_type, provisioning_model))

    def quota(self, zone: str) -> None:
        with self._lock:
            self._quota.add(zone)

    def lose_next_insert_response(self) -> None:
        with self._lock:
            self._lose_next_insert = True

    def preempt(self, project: str, zone: str, name: str) -> None:
        with self._lock:
            inst = self.instances[(project, zone, name)]
            if inst.get("scheduling", {}).get("instanceTerminationAction") == "STOP":
                inst["status"] = "TERMINATED"
                inst["lastStopTimestamp"] = _now()
            else:
                del self.instances[(project, zone, name)]

    # ---- helpers for tests ----
    def inserts(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("/instances")]

    # ---- routing ----
    def _route(self, req: Request) -> tuple[int, dict]:
        with self._lock:
            self.requests.append(req)
            p = req.path
            m = re.fullmatch(r"/compute/v1/projects/([^/]+)/aggregated/instances", p)
            if m and req.method == "GET":
                return self._aggregated(m.group(1), req.query.get("filter", ""))
            m = re.fullmatch(r"/compute/v1/projects/([^/]+)/zones/([^/]+)/instances", p)
            if m and req.method == "POST":
                return self._insert(m.group(1), m.group(2), req)
            if m and req.method == "GET":
                return self._list(m.group(1), m.group(2), req.query.get("filter", ""))
            m = re.fullmatch(r"/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)", p)
            if m and req.method == "GET":
                inst = self._instance(*m.groups())
                return (200, inst) if inst else self._not_found(*m.groups())
            if m and req.method == "DELETE":
                return self._delete(*m.groups(), req)
            m = re.fullmatch(
                r"/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)/setLabels", p)
            if m and req.method == "POST":
                return self._set_labels(*m.groups(), req)
            m = re.fullmatch(
                r"/compute/v1/projects/([^/]+)/zones/([^/]+)/operations/([^/]+?)(/wait)?", p)
            if m:
                return self._operation(m.group(3))
            return 404, _error(404, f"fake compute: no route for {req.method} {p}", "notFound")

    def _not_found(self, project: str, zone: str, name: str) -> tuple[int, dict]:
        message = f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found"
        return 404, _error(404, message, "notFound")

    def _instance(self, project: str, zone: str, name: str) -> dict | None:
        inst = self.instances.get((project, zone, name))
        if inst is not None and inst["status"] in ("PROVISIONING", "STAGING"):
            inst["status"] = "RUNNING"  # boots between two looks
        return inst

    def _new_operation(self, project: str, zone: str, kind: str, target: str,
                       error: dict | None = None) -> dict:
        name = f"operation-{int(time.time() * 1000)}-{next(_ids):x}"
        zone_url = f"{BASE}/projects/{project}/zones/{zone}"
        op = {
            "kind": "compute#operation", "id": str(next(_ids)), "name": name,
            "zone": zone_url, "operationType": kind,
            "targetLink": f"{zone_url}/instances/{target}", "targetId": str(next(_ids)),
            "status": "RUNNING", "user": "fake@example.com", "progress": 0,
            "insertTime": _now(), "startTime": _now(),
            "selfLink": f"{zone_url}/operations/{name}",
        }
        self.operations[name] = op
        if error is not None:
            self._pending_errors[name] = error
        return op

    def _operation(self, name: str) -> tuple[int, dict]:
        op = self.operations.get(name)
        if op is None:
            return 404, _error(404, f"The resource 'operations/{name}' was not found",
                               "notFound")
        if op["status"] != "DONE":
            op.update(status="DONE", progress=100, endTime=_now())
            error = self._pending_errors.pop(name, None)
            if error is not None:
                op.update(error)
        return 200, op

    def _insert(self, project: str, zone: str, req: Request) -> tuple[int, dict]:
        request_id = req.query.get("requestId")
        if request_id and request_id in self._by_request_id:
            return 200, self._by_request_id[request_id]
        body = req.body or {}
        name = body.get("name", "")
        machine = body.get("machineType", "").rsplit("/", 1)[-1]
        model = body.get("scheduling", {}).get("provisioningModel", "STANDARD")
        if zone in self._quota:
            message = (f"Quota 'PREEMPTIBLE_CPUS' exceeded.  Limit: 0.0 in region "
                       f"{zone.rsplit('-', 1)[0]}.")
            return 403, _error(403, message, "quotaExceeded", "usageLimits")
        if (project, zone, name) in self.instances:
            message = f"The resource 'projects/{project}/zones/{zone}/instances/{name}' " \
                      "already exists"
            return 409, _error(409, message, "alreadyExists")
        exhausted = any(z == zone and (mt is None or mt == machine)
                        and (pm is None or pm == model) for z, mt, pm in self._exhausted)
        if exhausted:
            error = {
                "error": {"errors": [{
                    "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                    "message": f"The zone 'projects/{project}/zones/{zone}' does not have "
                               "enough resources available to fulfill the request.  Try a "
                               "different zone, or try again later.",
                }]},
                "httpErrorStatusCode": 503,
                "httpErrorMessage": "SERVICE UNAVAILABLE",
            }
            op = self._new_operation(project, zone, "insert", name, error)
        else:
            zone_url = f"{BASE}/projects/{project}/zones/{zone}"
            inst = json.loads(json.dumps(body))
            labels = inst.get("labels", {})
            for nic in inst.get("networkInterfaces", []):
                nic["networkIP"] = f"10.128.0.{next(self._next_ip)}"
                for ac in nic.get("accessConfigs", []):
                    ac["natIP"] = f"34.1.0.{next(self._next_ip)}"
            inst.update(
                kind="compute#instance", id=str(next(_ids)), status="PROVISIONING",
                zone=zone_url, creationTimestamp=_now(), labelFingerprint=_fingerprint(labels),
                machineType=f"{zone_url}/machineTypes/{machine}",
                selfLink=f"{zone_url}/instances/{name}",
            )
            self.instances[(project, zone, name)] = inst
            op = self._new_operation(project, zone, "insert", name)
        if request_id:
            self._by_request_id[request_id] = op
        if self._lose_next_insert:
            self._lose_next_insert = False
            return 503, _error(503, "Internal error. Please try again or contact Google "
                                    "Support.", "backendError")
        return 200, op

    def _matches(self, inst: dict, flt: str) -> bool:
        for key, value in re.findall(r'([\w.-]+)\s*=\s*"([^"]*)"', flt):
            if key.startswith("labels."):
                if inst.get("labels", {}).get(key[len("labels."):]) != value:
                    return False
            elif str(inst.get(key)) != value:
                return False
        return True

    def _list(self, project: str, zone: str, flt: str) -> tuple[int, dict]:
        items = [self._instance(p, z, n) for (p, z, n) in list(self.instances)
                 if p == project and z == zone]
        items = [i for i in items if self._matches(i, flt)]
        out = {"kind": "compute#instanceList",
               "id": f"projects/{project}/zones/{zone}/instances",
               "selfLink": f"{BASE}/projects/{project}/zones/{zone}/instances"}
        if items:
            out["items"] = items
        return 200, out

    def _aggregated(self, project: str, flt: str) -> tuple[int, dict]:
        zones = sorted({z for (p, z, _) in self.instances if p == project})
        items = {}
        for zone in zones:
            _, listing = self._list(project, zone, flt)
            if listing.get("items"):
                items[f"zones/{zone}"] = {"instances": listing["items"]}
            else:
                items[f"zones/{zone}"] = {"warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": f"There are no results for scope 'zones/{zone}' on this page.",
                    "data": [{"key": "scope", "value": f"zones/{zone}"}]}}
        return 200, {"kind": "compute#instanceAggregatedList",
                     "id": f"projects/{project}/aggregated/instances", "items": items,
                     "selfLink": f"{BASE}/projects/{project}/aggregated/instances"}

    def _delete(self, project: str, zone: str, name: str, req: Request) -> tuple[int, dict]:
        request_id = req.query.get("requestId")
        if request_id and request_id in self._by_request_id:
            return 200, self._by_request_id[request_id]
        if (project, zone, name) not in self.instances:
            return self._not_found(project, zone, name)
        del self.instances[(project, zone, name)]
        op = self._new_operation(project, zone, "delete", name)
        if request_id:
            self._by_request_id[request_id] = op
        return 200, op

    def _set_labels(self, project: str, zone: str, name: str,
                    req: Request) -> tuple[int, dict]:
        inst = self.instances.get((project, zone, name))
        if inst is None:
            return self._not_found(project, zone, name)
        body = req.body or {}
        if body.get("labelFingerprint") != inst["labelFingerprint"]:
            return 412, _error(412, "Labels fingerprint either invalid or resource labels "
                                    "have changed", "conditionNotMet")
        inst["labels"] = dict(body.get("labels", {}))
        inst["labelFingerprint"] = _fingerprint(inst["labels"])
        return 200, self._new_operation(project, zone, "setLabels", name)
