"""moshray.actors."""
