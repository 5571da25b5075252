"""moshray.jobs.bench."""
