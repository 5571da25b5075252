"""The metadata servers the tests script (they ship with the product: the embedded cluster
delivers its spot notices through them)."""

from moshray.autoscaler.clouds.metadata_emulator import (  # noqa: F401
    GCEMetadataServer,
    IMDSv2Server,
    Seen,
    iso_utc,
)
