"""moshray.jobs.examples.lm.example."""
