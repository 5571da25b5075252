"""moshray.autoscaler.clouds.gcp."""
