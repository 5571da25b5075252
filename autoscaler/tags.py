"""Names shared by the NodeProviders, the cluster YAMLs, the watcher and the Terraform modules.

One place, so that what Terraform tags, what the IAM policy conditions on, and what the
providers filter on cannot drift apart (``tests/test_infra_bootstrap.py`` checks the
Terraform side).
GCP label keys and values allow only lowercase letters, digits, ``_`` and ``-``; every name
here is valid as both an AWS tag key and a GCP label key.
"""

from __future__ import annotations

# Value: the cluster name. Every instance a provider manages carries it; listing filters on it
# and the head's IAM policy allows terminate/tag only on instances that carry it.
CLUSTER_TAG = "moshray-cluster"
# Value: "head" or "worker".
ROLE_TAG = "moshray-role"
# Value: the pool the instance was launched from (autoscaler/pools/records.py encodes it).
POOL_TAG = "moshray-pool"
# Value: "spot" or "on-demand".
MARKET_TAG = "moshray-market"

# The `provider: type: external` module paths of Ray's autoscaler config.
AWS_PROVIDER = "moshray.autoscaler.clouds.aws.provider.AWSSpotNodeProvider"
GCP_PROVIDER = "moshray.autoscaler.clouds.gcp.provider.GCPSpotNodeProvider"

# Where the Prometheus exporter listens by default (the Coordinator serves it).
METRICS_PORT = 9450
# Where the NodeProviders' own Prometheus endpoint listens, on the head's loopback (they run in
# Ray's autoscaler process; provider.metrics_port changes it). See providers/metrics.py.
PROVIDER_METRICS_PORT = 9451
