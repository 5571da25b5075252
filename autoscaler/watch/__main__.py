"""``python -m moshray.autoscaler.watch``: the same as ``moshray watch``."""
import sys

from moshray.jobs.cli import run_module

sys.exit(run_module("moshray.autoscaler.watch"))
