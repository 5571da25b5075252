"""``GCPSpotNodeProvider``: Ray autoscaler NodeProvider launching GCE Spot VMs by pool.

Plugged in with::

    provider:
      type: external
      module: moshray.autoscaler.clouds.gcp.provider.GCPSpotNodeProvider
      project_id: my-project
      availability_zone: us-central1-a   # zone of node types that do not name one (the head)
      termination_action: DELETE         # or STOP: what GCE does to a preempted Spot VM
      api_endpoint: http://127.0.0.1:8080   # optional (a local endpoint); default: GCE
      anonymous_credentials: false        # true only for a local endpoint
      operation_timeout_s: 300
      pools:
        - {machine_type: g2-standard-4, zone: us-central1-a}
        - {machine_type: g2-standard-4, zone: us-central1-b}
      on_demand: {max_nodes: 1}
      head_service_account: moshray-head@my-project.iam.gserviceaccount.com
      worker_service_account: moshray-worker@my-project.iam.gserviceaccount.com
      metrics_port: 9451                  # provider metrics on the head's loopback
      spot_prices: {g2-standard-4: 0.28}  # GCE has no spot price API: configured prices
                                          # (the controller's PriceBook also has price_table.json)

``bootstrap_config`` (``ray up``) puts the service accounts into the node types
(providers/config.py bootstrap_identity).

``node_config`` of a node type is a GCE ``Instance`` resource in REST JSON (disks,
networkInterfaces, guestAccelerators, serviceAccounts, metadata, ...). The pool decides
``machineType``, the zone and the provisioning model; ``{zone}`` and ``{region}`` inside any
string of node_config are replaced by the pool's zone and region (e.g.
``diskType: zones/{zone}/diskTypes/pd-balanced``, ``subnetwork:
regions/{region}/subnetworks/default``). Spot VMs get ``scheduling.provisioningModel: SPOT``,
``instanceTerminationAction`` as configured, ``automaticRestart: false`` and
``onHostMaintenance: TERMINATE``; on-demand ones ``provisioningModel: STANDARD``. The pool key
is also set as the metadata attribute ``moshray-pool``, so the node's watcher can read it from
the metadata server (``instance/attributes/moshray-pool``).

Node labels: the pool decides each VM's machine type, zone and provisioning model, which the
metadata server then reports (``instance/machine-type``, ``instance/zone``,
``instance/scheduling/preemptible``); the node's ``ray start`` turns them into its Ray labels
(``ray.io/market-type``, ``moshray-instance-type``, ...: node_labels.py,
infra/ray/cluster-gcp.yaml), which the controller prices nodes by.

Tags are GCE labels. Label values allow only lowercase letters, digits, ``-`` and ``_``, so
the values of Ray's ``ray-*`` tags are escaped reversibly (:func:`encode_label_value`, e.g.
``ray.head.default`` -> ``ray_2ehead_2edefault``); the moshray-* labels are stored as they
are (they are label-safe by construction), so Terraform and IAM conditions can match them.

Each VM is one ``instances.insert`` with a ``requestId`` derived from the attempt's token
(a retried insert is answered with the first operation, not a second VM); the provider waits
for the zonal operation (through a ZoneOperationsClient on the same endpoint) to learn whether
the zone had capacity: ``ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS]`` and quota errors make
the launch move to the next pool.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1
from google.protobuf.json_format import ParseError

from moshray.autoscaler.pools import Market, Pool
from moshray.autoscaler.providers.api import SpotNodeProviderBase
from moshray.autoscaler.providers.config import NODE_POOLS_KEY, optional, require
from moshray.autoscaler.providers.records import LaunchError, NodeRecord
from moshray.autoscaler.tags import CLUSTER_TAG, POOL_TAG, ROLE_TAG

log = logging.getLogger(__name__)

# Operation / API error codes meaning "this zone or quota cannot take it now".
_CAPACITY_RE = re.compile(
    r"ZONE_RESOURCE_POOL_EXHAUSTED(_WITH_DETAILS)?|RESOURCE_POOL_EXHAUSTED|QUOTA_EXCEEDED"
    r"|quotaExceeded|STOCKOUT|resourcePoolExhausted"
)
_LIVE = ("PROVISIONING", "STAGING", "RUNNING", "REPAIRING")
_TERMINATION_ACTIONS = ("DELETE", "STOP")
_LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_SAFE = set("abcdefghijklmnopqrstuvwxyz0123456789-")
_REQUEST_NS = uuid.UUID("5d4b4a8e-7b1c-4b8f-9f3e-6d6f73687261")
_TRANSPORT_ATTEMPTS = 3
_RAY_PREFIX = "ray-"


def encode_label_value(value: str) -> str:
    """Reversible escape into a GCE label value: ``[a-z0-9-]`` kept, every other byte as
    ``_xx`` (hex). Raises ValueError if the result exceeds 63 characters."""
    out = []
    for ch in value:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    encoded = "".join(out)
    if len(encoded) > 63:
        raise ValueError(f"tag value {value!r} is too long for a GCE label once escaped")
    return encoded


def decode_label_value(value: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(value):
        if value[i] == "_":
            raw.append(int(value[i + 1:i + 3], 16))
            i += 3
        else:
            raw.extend(value[i].encode())
            i += 1
    return raw.decode()


def tags_to_labels(tags: Mapping[str, str]) -> dict[str, str]:
    """Ray tags (``ray-*``) escaped; other tags must already be label-safe."""
    labels = {}
    for key, value in tags.items():
        if not _LABEL_KEY_RE.match(key):
            raise ValueError(f"tag key {key!r} is not a valid GCE label key "
                             "(lowercase letter first, then [a-z0-9_-], at most 63)")
        if key.startswith(_RAY_PREFIX):
            value = encode_label_value(value)
        elif not _LABEL_VALUE_RE.match(value):
            raise ValueError(f"tag {key}={value!r}: GCE label values allow only [a-z0-9_-]")
        labels[key] = value
    return labels


def labels_to_tags(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: decode_label_value(v) if k.startswith(_RAY_PREFIX) else v
            for k, v in labels.items()}


def _substitute(value: Any, zone: str) -> Any:
    region = zone.rsplit("-", 1)[0]
    if isinstance(value, str):
        return value.replace("{zone}", zone).replace("{region}", region)
    if isinstance(value, list):
        return [_substitute(v, zone) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, zone) for k, v in value.items()}
    return value


def _timestamp(text: str) -> float:
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return 0.0


def _record_from_instance(inst: compute_v1.Instance) -> NodeRecord:
    labels = dict(inst.labels)
    tags = labels_to_tags(labels)
    status = inst.status
    nic = inst.network_interfaces[0] if inst.network_interfaces else None
    internal = nic.network_i_p if nic is not None and nic.network_i_p else None
    external = None
    if nic is not None and nic.access_configs and nic.access_configs[0].nat_i_p:
        external = nic.access_configs[0].nat_i_p
    spot = inst.scheduling.provisioning_model == "SPOT"
    return NodeRecord(
        node_id=inst.name,
        live=status in _LIVE,
        running=status == "RUNNING",
        tags=tags,
        internal_ip=internal,
        external_ip=external,
        launched_at=_timestamp(inst.creation_timestamp),
        # A stopped (TERMINATED) Spot VM was stopped by GCE's preemption (action STOP).
        reclaimed=spot and status in ("STOPPING", "TERMINATED"),
        state_reason=status,
        zone=inst.zone.rsplit("/", 1)[-1] if inst.zone else None,
    )


def _error_text(exc: gexc.GoogleAPICallError) -> str:
    parts = [exc.message or ""]
    parts += [json.dumps(e) if isinstance(e, dict) else str(e) for e in (exc.errors or [])]
    if getattr(exc, "reason", None):
        parts.append(str(exc.reason))
    return " ".join(parts)


class GCPSpotNodeProvider(SpotNodeProviderBase):
    """GCE Spot VMs across pools; see the module docstring for the config."""

    cloud = "gcp"

    def __init__(self, provider_config: dict[str, Any], cluster_name: str, **kwargs: Any) -> None:
        if not _LABEL_VALUE_RE.match(cluster_name) or not cluster_name:
            raise ValueError(f"cluster_name {cluster_name!r} must be lowercase letters, digits,"
                             " '-' and '_' (it becomes a GCE label value)")
        super().__init__(provider_config, cluster_name, **kwargs)
        self.project = require(provider_config, "project_id", str)
        self._default_zone = optional(provider_config, "availability_zone", str, None)
        action = optional(provider_config, "termination_action", str, "DELETE")
        if action not in _TERMINATION_ACTIONS:
            raise ValueError(f"provider.termination_action must be DELETE or STOP, got {action!r}")
        self.termination_action = action
        self._op_timeout = float(optional(provider_config, "operation_timeout_s", (int, float),
                                          300))
        endpoint = optional(provider_config, "api_endpoint", str, None)
        anonymous = optional(provider_config, "anonymous_credentials", bool, False)
        options = ClientOptions(api_endpoint=endpoint) if endpoint else None
        credentials = AnonymousCredentials() if anonymous else None
        self.instances = compute_v1.InstancesClient(
            credentials=credentials, client_options=options, transport="rest")
        # Operations are polled on the same endpoint (the insert's own ExtendedOperation
        # would poll a client built without these options).
        self.operations = compute_v1.ZoneOperationsClient(
            credentials=credentials, client_options=options, transport="rest")
        self._name_prefix = "ray-" + re.sub(r"[^a-z0-9-]", "-", cluster_name)[:30].strip("-")

    # ------------------------------------------------------------------ hooks
    def _default_pool(self, node_config: Mapping[str, Any]) -> Pool:
        machine = str(node_config.get("machineType", "")).rsplit("/", 1)[-1]
        if not machine:
            raise ValueError("node_config needs machineType (or configure provider.pools)")
        if not self._default_zone:
            raise ValueError("set provider.availability_zone (the zone of the head node)")
        return Pool("gcp", machine, self._default_zone, Market.SPOT)

    def _cloud_list(self) -> list[NodeRecord]:
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project,
            filter=f'labels.{CLUSTER_TAG} = "{self.cluster_name}"',
        )
        records = []
        for _scope, scoped in self.instances.aggregated_list(request=request):
            records += [_record_from_instance(i) for i in scoped.instances]
        return records

    def _zone_of(self, node_id: str) -> str | None:
        with self._lock:
            rec = self._nodes.get(node_id)
        if rec is not None and rec.zone:
            return rec.zone
        for rec in self._cloud_list():
            if rec.node_id == node_id:
                return rec.zone
        return None

    def _cloud_fetch(self, node_id: str) -> NodeRecord | None:
        zone = self._zone_of(node_id)
        if zone is None:
            return None
        try:
            inst = self.instances.get(project=self.project, zone=zone, instance=node_id)
        except gexc.NotFound:
            return None
        rec = _record_from_instance(inst)
        return rec if rec.tags.get(CLUSTER_TAG) == self.cluster_name else None

    def instance_body(self, pool: Pool, node_config: Mapping[str, Any],
                      tags: Mapping[str, str], name: str) -> dict[str, Any]:
        """The Instance resource (REST JSON) for one VM of ``pool`` (pure; for tests/logs)."""
        body = _substitute(copy.deepcopy({k: v for k, v in node_config.items()
                                          if k != NODE_POOLS_KEY}), pool.zone)
        body["name"] = name
        body["machineType"] = f"zones/{pool.zone}/machineTypes/{pool.instance_type}"
        body["labels"] = {**(body.get("labels") or {}), **tags_to_labels(tags)}
        scheduling = dict(body.get("scheduling") or {})
        if pool.is_spot:
            scheduling.pop("preemptible", None)
            scheduling.update(provisioningModel="SPOT",
                              instanceTerminationAction=self.termination_action,
                              automaticRestart=False, onHostMaintenance="TERMINATE")
        else:
            scheduling.pop("instanceTerminationAction", None)
            scheduling["provisioningModel"] = "STANDARD"
        body["scheduling"] = scheduling
        # The pool also as a metadata attribute: readable on the VM from the metadata server
        # (instance/attributes/moshray-pool), where labels are not.
        metadata = dict(body.get("metadata") or {})
        items = [i for i in metadata.get("items") or [] if i.get("key") != POOL_TAG]
        metadata["items"] = items + [{"key": POOL_TAG, "value": pool.key}]
        body["metadata"] = metadata
        return body

    def _wait(self, zone: str, op: compute_v1.Operation) -> compute_v1.Operation:
        deadline = time.monotonic() + self._op_timeout
        while op.status != compute_v1.Operation.Status.DONE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"operation {op.name} not done after {self._op_timeout}s")
            op = self.operations.wait(project=self.project, zone=zone, operation=op.name,
                                      timeout=min(left, 120.0))
        return op

    def _insert_one(self, pool: Pool, body: dict[str, Any], request_id: str) -> None:
        """Insert one VM and wait for its operation; raises LaunchError."""
        try:
            instance = compute_v1.Instance.from_json(json.dumps(body))
        except ParseError as exc:
            raise LaunchError("InvalidNodeConfig", str(exc).splitlines()[0],
                              capacity=False) from None
        last: Exception | None = None
        for _ in range(_TRANSPORT_ATTEMPTS):
            try:
                op = self.instances.insert_unary(request=compute_v1.InsertInstanceRequest(
                    project=self.project, zone=pool.zone, instance_resource=instance,
                    request_id=request_id))
                op = self._wait(pool.zone, op)
                break
            except gexc.GoogleAPICallError as exc:
                if isinstance(exc, (gexc.ServiceUnavailable, gexc.GatewayTimeout)) and \
                        not _CAPACITY_RE.search(_error_text(exc)):
                    last = exc  # transient: same requestId again
                    continue
                text = _error_text(exc)
                found = _CAPACITY_RE.search(text)
                raise LaunchError(found.group(0) if found else type(exc).__name__,
                                  exc.message or text, capacity=bool(found)) from None
            except (gexc.RetryError, OSError) as exc:  # timeouts, dropped connections
                last = exc
                continue
        else:
            raise LaunchError(type(last).__name__, str(last), capacity=False)
        errors = list(op.error.errors) if op.error else []
        if errors:
            code = errors[0].code or str(op.http_error_status_code)
            message = errors[0].message or op.http_error_message
            raise LaunchError(code, message, capacity=bool(_CAPACITY_RE.search(code)))

    def _cloud_launch(self, pool: Pool, node_config: dict[str, Any], tags: dict[str, str],
                      count: int, token: str) -> list[NodeRecord]:
        created: list[NodeRecord] = []
        role = "head" if tags.get(ROLE_TAG) == "head" else "worker"
        for index in range(count):
            key = uuid.uuid5(_REQUEST_NS, f"{token}/{index}")
            name = f"{self._name_prefix}-{role}-{key.hex[:10]}"
            body = self.instance_body(pool, node_config, tags, name)
            try:
                self._insert_one(pool, body, str(key))
            except LaunchError as exc:
                raise LaunchError(exc.code, exc.message, exc.capacity, tuple(created)) from None
            rec = self._fetch_in_zone(name, pool.zone)
            if rec is None:  # inserted but not readable yet: serve from what we sent
                rec = NodeRecord(node_id=name, live=True, running=False, tags=dict(tags),
                                 launched_at=time.time(), zone=pool.zone)
            created.append(rec)
        return created

    def _fetch_in_zone(self, name: str, zone: str) -> NodeRecord | None:
        try:
            return _record_from_instance(
                self.instances.get(project=self.project, zone=zone, instance=name))
        except gexc.NotFound:
            return None

    def _cloud_terminate(self, records: list[NodeRecord]) -> None:
        failures = []
        for rec in records:
            zone = rec.zone or self._zone_of(rec.node_id)
            if zone is None:
                continue  # already gone
            try:
                self.instances.delete_unary(request=compute_v1.DeleteInstanceRequest(
                    project=self.project, zone=zone, instance=rec.node_id,
                    request_id=str(uuid.uuid5(_REQUEST_NS, f"delete/{zone}/{rec.node_id}"))))
            except gexc.NotFound:
                continue
            except gexc.GoogleAPICallError as exc:
                failures.append(f"{rec.node_id}: {exc.message}")
        if failures:
            raise RuntimeError("; ".join(failures))

    def _cloud_set_tags(self, record: NodeRecord, tags: dict[str, str]) -> None:
        zone = record.zone or self._zone_of(record.node_id)
        if zone is None:
            raise RuntimeError(f"node {record.node_id} not found")
        labels = tags_to_labels(tags)
        for _ in range(2):  # a stale fingerprint (412) is refreshed once
            current = self.instances.get(project=self.project, zone=zone,
                                         instance=record.node_id)
            request = compute_v1.InstancesSetLabelsRequest(
                labels={**dict(current.labels), **labels},
                label_fingerprint=current.label_fingerprint)
            try:
                op = self.instances.set_labels_unary(request=compute_v1.SetLabelsInstanceRequest(
                    project=self.project, zone=zone, instance=record.node_id,
                    instances_set_labels_request_resource=request,
                    request_id=str(uuid.uuid4())))
            except gexc.PreconditionFailed:
                continue
            op = self._wait(zone, op)
            if op.error and op.error.errors:
                raise RuntimeError(f"setLabels: {op.error.errors[0].code}: "
                                   f"{op.error.errors[0].message}")
            return
        raise RuntimeError(f"setLabels on {record.node_id}: label fingerprint kept changing")
