"""moshray.jobs.controller.elastic."""
