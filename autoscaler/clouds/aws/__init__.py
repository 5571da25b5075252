"""moshray.autoscaler.clouds.aws."""
