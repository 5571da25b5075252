"""moshray.cluster.coordinator.actor."""
