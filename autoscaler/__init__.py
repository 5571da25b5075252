"""moshray.autoscaler."""
