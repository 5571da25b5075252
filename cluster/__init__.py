"""moshray.cluster."""
