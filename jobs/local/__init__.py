"""moshray.jobs.local."""
