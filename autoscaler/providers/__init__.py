"""moshray.autoscaler.providers."""
