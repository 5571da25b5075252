"""``AWSSpotNodeProvider``: Ray autoscaler NodeProvider launching EC2 spot instances by pool.

Plugged in with::

    provider:
      type: external
      module: moshray.autoscaler.clouds.aws.provider.AWSSpotNodeProvider
      region: us-east-1
      availability_zone: us-east-1a   # zone of node types that do not name one (the head)
      endpoint_url: http://127.0.0.1:5000   # optional (moto); default: the real EC2 endpoint
      pools:
        - {instance_type: g4dn.xlarge, zone: us-east-1a, subnet_id: subnet-aaa}
        - {instance_type: g4dn.xlarge, zone: us-east-1b, subnet_id: subnet-bbb}
      on_demand: {max_nodes: 2}
      # capacity_cooldown_s, max_cooldown_s, preemption_window_s, spot_stable_s,
      # return_to_spot, visibility_grace_s: see provider_config.PlacementConfig
      head_instance_profile_arn: arn:aws:iam::123456789012:instance-profile/moshray-head
      worker_instance_profile_arn: arn:aws:iam::123456789012:instance-profile/moshray-worker
      metrics_port: 9451                  # provider metrics on the head's loopback
      spot_prices: {g4dn.xlarge: 0.20}    # example: used when the spot price history has none
      spot_price_ttl_s: 300

``bootstrap_config`` (``ray up``) puts the instance profiles into the node types
(providers/config.py bootstrap_identity). Spot prices come from EC2's spot price history
(:meth:`AWSSpotNodeProvider.spot_price_history`, prices.py); ``spot_prices`` is only the
fallback for a (type, zone) the history does not answer.

Node labels: the pool decides each instance's type, zone and market (``InstanceMarketOptions``
spot, or none: on-demand), which the instance's metadata (IMDS ``instance-type``,
``placement/availability-zone``, ``instance-life-cycle``) then reports; the node's
``ray start`` turns them into its Ray labels (``ray.io/market-type``, ``moshray-instance-type``,
...: node_labels.py, infra/ray/cluster-aws.yaml), which the controller prices nodes by.

``node_config`` of a node type is passed to ``RunInstances`` (ImageId, KeyName,
SecurityGroupIds, IamInstanceProfile, BlockDeviceMappings, UserData, ...), except that the
pool decides ``InstanceType``, the zone (``SubnetId`` from the pool, else
``Placement.AvailabilityZone``) and the market; a node type may list its own pools under
``moshray_pools``. ``SubnetIds`` (Ray's list form) is accepted: its first entry is used when
the pool names no subnet.

Per attempt: ``MinCount = MaxCount = n`` (a pool gives all n or refuses), the spot market
options (one-time, terminate on interruption; ``SpotOptions`` from node_config kept, e.g.
``MaxPrice``), the instance tags (Ray's tags plus moshray-cluster/-role/-pool/-market), and a
``ClientToken``; transport errors (timeouts, dropped connections) are retried with the same
token, which EC2 answers with the first request's result instead of launching again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from moshray.autoscaler.pools import Market, Pool
from moshray.autoscaler.clouds.aws.prices import ec2_spot_price_history
from moshray.autoscaler.clouds.prices import Fetch
from moshray.autoscaler.providers.api import SpotNodeProviderBase
from moshray.autoscaler.providers.config import NODE_POOLS_KEY, optional, require
from moshray.autoscaler.providers.records import LaunchError, NodeRecord
from moshray.autoscaler.tags import CLUSTER_TAG

log = logging.getLogger(__name__)

# Error codes meaning "this pool (its capacity, spot price or quota) cannot take the launch
# now"; another pool may. Everything else is treated as a bad request.
CAPACITY_ERROR_CODES = frozenset({
    "InsufficientInstanceCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientCapacity",
    "UnfulfillableCapacity",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "Unsupported",  # the type is not offered in that zone
    "InsufficientFreeAddressesInSubnet",
})
_TRANSPORT_ERRORS = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
)
_LIVE = ("pending", "running")
_TRANSPORT_ATTEMPTS = 3


def _to_aws_tags(tags: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _record_from_instance(inst: Mapping[str, Any]) -> NodeRecord:
    tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
    state = inst["State"]["Name"]
    reason = (inst.get("StateReason") or {}).get("Code") or ""
    launch_time = inst.get("LaunchTime")
    return NodeRecord(
        node_id=inst["InstanceId"],
        live=state in _LIVE,
        running=state == "running",
        tags=tags,
        internal_ip=inst.get("PrivateIpAddress"),
        external_ip=inst.get("PublicIpAddress"),
        launched_at=launch_time.timestamp() if launch_time is not None else 0.0,
        # "Server.SpotInstanceTermination", "Server.SpotInstanceShutdown", ...: EC2 ended it.
        reclaimed=state not in _LIVE and reason.startswith("Server."),
        state_reason=reason,
        zone=(inst.get("Placement") or {}).get("AvailabilityZone"),
    )


class AWSSpotNodeProvider(SpotNodeProviderBase):
    """EC2 spot instances across pools; see the module docstring for the config."""

    cloud = "aws"

    def __init__(self, provider_config: dict[str, Any], cluster_name: str, **kwargs: Any) -> None:
        super().__init__(provider_config, cluster_name, **kwargs)
        region = require(provider_config, "region", str)
        self._default_zone = optional(provider_config, "availability_zone", str, None)
        endpoint = optional(provider_config, "endpoint_url", str, None)
        session = boto3.session.Session(region_name=region)
        retrying = botocore.config.Config(retries={"max_attempts": 5, "mode": "standard"})
        # Launches fail fast (a refused pool should hand over to the next one at once);
        # transport errors are retried here, with the same ClientToken.
        once = botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"})
        self.ec2 = session.client("ec2", endpoint_url=endpoint, config=retrying)
        self._ec2_launch = session.client("ec2", endpoint_url=endpoint, config=once)

    # ------------------------------------------------------------------ hooks
    def _price_fetch(self) -> Fetch:
        return self.spot_price_history

    def spot_price_history(self, instance_types: tuple[str, ...],
                           zones: tuple[str, ...]) -> list[dict[str, Any]]:
        """EC2's spot price records for these types and zones from now on (the reader the
        controller's PriceBook uses too: aws/prices.py ec2_spot_price_history)."""
        return ec2_spot_price_history(self.ec2, instance_types, zones)

    def _default_pool(self, node_config: Mapping[str, Any]) -> Pool:
        itype = node_config.get("InstanceType")
        if not itype:
            raise ValueError("node_config needs InstanceType (or configure provider.pools)")
        zone = (node_config.get("Placement") or {}).get("AvailabilityZone") or self._default_zone
        if not zone:
            raise ValueError("node_config needs Placement.AvailabilityZone "
                             "(or set provider.availability_zone)")
        subnet = node_config.get("SubnetId") or (node_config.get("SubnetIds") or [None])[0]
        return Pool("aws", itype, zone, Market.SPOT, subnet)

    def _cloud_list(self) -> list[NodeRecord]:
        paginator = self.ec2.get_paginator("describe_instances")
        filters = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [self.cluster_name]}]
        records = []
        for page in paginator.paginate(Filters=filters):
            for reservation in page.get("Reservations", []):
                records += [_record_from_instance(i) for i in reservation.get("Instances", [])]
        return records

    def _cloud_fetch(self, node_id: str) -> NodeRecord | None:
        try:
            resp = self.ec2.describe_instances(InstanceIds=[node_id])
        except botocore.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"].startswith("InvalidInstanceID"):
                return None
            raise
        for reservation in resp.get("Reservations", []):
            for inst in reservation.get("Instances", []):
                rec = _record_from_instance(inst)
                if rec.tags.get(CLUSTER_TAG) == self.cluster_name:
                    return rec
        return None

    def run_instances_request(self, pool: Pool, node_config: Mapping[str, Any],
                              tags: Mapping[str, str], count: int,
                              token: str) -> dict[str, Any]:
        """The RunInstances parameters for one attempt (pure; exposed for tests and logs)."""
        conf = {k: v for k, v in node_config.items() if k not in (NODE_POOLS_KEY, "SubnetIds")}
        subnet = pool.subnet_id or conf.get("SubnetId") or (node_config.get("SubnetIds") or
                                                              [None])[0]
        conf["InstanceType"] = pool.instance_type
        if "NetworkInterfaces" in conf:
            nics = [dict(n) for n in conf["NetworkInterfaces"]]
            if subnet and nics:
                nics[0]["SubnetId"] = subnet
            conf["NetworkInterfaces"] = nics
            conf.pop("SubnetId", None)
            conf.pop("SecurityGroupIds", None)  # they belong to the interfaces then
        elif subnet:
            conf["SubnetId"] = subnet
        if not subnet:
            placement = dict(conf.get("Placement") or {})
            placement["AvailabilityZone"] = pool.zone
            conf["Placement"] = placement
        else:
            placement = {k: v for k, v in (conf.get("Placement") or {}).items()
                         if k != "AvailabilityZone"}  # the subnet fixes the zone
            if placement:
                conf["Placement"] = placement
            else:
                conf.pop("Placement", None)
        if pool.is_spot:
            user = (conf.get("InstanceMarketOptions") or {}).get("SpotOptions") or {}
            spot = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            spot.update({k: v for k, v in user.items()
                         if k not in ("SpotInstanceType", "InstanceInterruptionBehavior")})
            conf["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        else:
            conf.pop("InstanceMarketOptions", None)
        instance_tags = dict(tags)
        other_specs = []
        for spec in conf.get("TagSpecifications") or []:
            if spec.get("ResourceType") == "instance":
                user_tags = {t["Key"]: t["Value"] for t in spec.get("Tags", [])}
                instance_tags = {**user_tags, **instance_tags}  # ours win on our keys
            else:
                other_specs.append(spec)
        if "ray-node-name" in instance_tags and "Name" not in instance_tags:
            instance_tags["Name"] = instance_tags["ray-node-name"]
        conf["TagSpecifications"] = [
            {"ResourceType": "instance", "Tags": _to_aws_tags(instance_tags)}] + other_specs
        conf["MinCount"] = conf["MaxCount"] = count
        conf["ClientToken"] = token
        return conf

    def _cloud_launch(self, pool: Pool, node_config: dict[str, Any], tags: dict[str, str],
                      count: int, token: str) -> list[NodeRecord]:
        request = self.run_instances_request(pool, node_config, tags, count, token)
        last_transport: Exception | None = None
        for _ in range(_TRANSPORT_ATTEMPTS):
            try:
                resp = self._ec2_launch.run_instances(**request)
            except botocore.exceptions.ClientError as exc:
                error = exc.response.get("Error", {})
                code = error.get("Code", "Unknown")
                raise LaunchError(code, error.get("Message", str(exc)),
                                  capacity=code in CAPACITY_ERROR_CODES) from None
            except _TRANSPORT_ERRORS as exc:
                last_transport = exc  # same ClientToken next time: no double launch
                log.warning("aws provider: RunInstances transport error, retrying: %s", exc)
                continue
            return [_record_from_instance(i) for i in resp.get("Instances", [])]
        raise LaunchError(type(last_transport).__name__, str(last_transport), capacity=False)

    def _cloud_terminate(self, records: list[NodeRecord]) -> None:
        self.ec2.terminate_instances(InstanceIds=[r.node_id for r in records])

    def _cloud_set_tags(self, record: NodeRecord, tags: dict[str, str]) -> None:
        changed = {k: v for k, v in tags.items() if record.tags.get(k) != v}
        if "ray-node-name" in changed:
            changed["Name"] = changed["ray-node-name"]
        if changed:
            self.ec2.create_tags(Resources=[record.node_id], Tags=_to_aws_tags(changed))

