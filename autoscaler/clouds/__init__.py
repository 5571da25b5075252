"""moshray.autoscaler.clouds."""
