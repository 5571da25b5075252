"""AWS as a moshray cloud: this package builds the AWS ``Cloud`` bundle and registers it.

Its parts, one module each: ``notices.py`` (``AWSMetadataSource``, spot interruption notices
and rebalance recommendations through IMDSv2), ``identity.py`` (how ``auto`` finds EC2, and a
node's pool from IMDSv2), ``emulator.py`` (``IMDSv2Server``, a local IMDSv2 for the embedded
cluster and the tests), ``prices.py`` (EC2's spot price history, zone -> region) and
``provider.py`` (``AWSSpotNodeProvider``, Ray's autoscaler NodeProvider; imported only when
asked for, as it needs boto3). The watcher's ``aws_interval_s`` is the source's IMDS check
period.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moshray.autoscaler.clouds.aws import identity, prices
from moshray.autoscaler.clouds.aws.emulator import IMDSv2Server
from moshray.autoscaler.clouds.aws.notices import AWS_METADATA_URL, AWSMetadataSource
from moshray.autoscaler.clouds.base import Cloud, register_cloud
from moshray.autoscaler.tags import AWS_PROVIDER


def _notice_options(watcher_config: Any) -> Mapping[str, Any]:
    return {"interval_s": watcher_config.aws_interval_s}


AWS = register_cloud(Cloud(
    name="aws",
    metadata_url=AWS_METADATA_URL,
    notice_source=AWSMetadataSource,
    notice_options=_notice_options,
    identity=identity.IDENTITY,
    emulator=IMDSv2Server,
    provider=AWS_PROVIDER,
    region=prices.region_of,
    spot_price_fetch=prices.ec2_fetch,
    read_pool=identity.read_pool,
))
