"""moshray.cluster.collective."""
