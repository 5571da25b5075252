"""moshray.jobs."""
