"""GCP prices: only the zone's region (the GCP bundle's ``region``).

GCP has no spot price API for Spot VMs (prices are in the Cloud Billing catalog, per region
and SKU), so the GCP bundle reads no live price: GCP nodes are priced from the shipped table
(``price_table.json``) or the configured prices (``clouds/prices.py``).
"""

from __future__ import annotations


def region_of(zone: str) -> str:
    """us-central1-a -> us-central1; "" for a name without a zone suffix."""
    return zone.rsplit("-", 1)[0] if "-" in zone else ""
