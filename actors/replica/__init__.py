"""moshray.actors.replica.actor."""
