"""The metadata servers the tests script (they ship with the product: the embedded cluster
delivers its spot notices through them; each lives with its cloud)."""

from moshray.autoscaler.clouds.aws.emulator import IMDSv2Server  # noqa: F401
from moshray.autoscaler.clouds.gcp.emulator import GCEMetadataServer  # noqa: F401
from moshray.autoscaler.clouds.metadata_emulator import Seen, iso_utc  # noqa: F401
