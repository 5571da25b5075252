"""Render the shipped prometheus.yml with other targets (a local cluster, a test).

The shipped ``prometheus.yml`` is the real-cluster configuration. This keeps its structure
and replaces only what differs elsewhere: the moshray exporters' targets (fixed ones, or the
job files the Coordinators write), the path of Ray's service-discovery file, and the scrape
interval. Usable as a script::

    python infra/prometheus/render.py --moshray 127.0.0.1:9450 \\
        --ray-sd /tmp/ray/session_latest/prom_metrics_service_discovery.json \\
        --interval 5s > prometheus.local.yml

or imported (``render(text, ...)``). Raises ``ValueError`` (one line) when the input lacks the
``moshray`` or ``ray`` job or a target is not ``host:port``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

SHIPPED = Path(__file__).with_name("prometheus.yml")
_TARGET = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
_DURATION = re.compile(r"^\d+(ms|s|m|h)$")


def render(
    text: str,
    moshray_targets: Sequence[str] | None = None,
    ray_sd_files: Sequence[str] | None = None,
    scrape_interval: str | None = None,
    moshray_sd_files: Sequence[str] | None = None,
) -> str:
    """``text`` (a prometheus.yml) with the given targets, files and interval substituted:
    ``moshray_targets`` (fixed exporters) or ``moshray_sd_files`` (the job files the
    Coordinators write, globs allowed) replace how the ``moshray`` job finds its exporters.

    Arguments left as None keep the value in ``text``.
    """
    config = yaml.safe_load(text)
    jobs = {job.get("job_name"): job for job in config.get("scrape_configs") or []}
    for name in ("moshray", "ray"):
        if name not in jobs:
            raise ValueError(f"prometheus config has no scrape job named {name!r}")
    if moshray_targets is not None:
        for target in moshray_targets:
            if not _TARGET.match(target):
                raise ValueError(f"moshray target must be host:port, got {target!r}")
        jobs["moshray"]["static_configs"] = [{"targets": list(moshray_targets)}]
        jobs["moshray"].pop("file_sd_configs", None)
    if moshray_sd_files is not None:
        sd = jobs["moshray"].get("file_sd_configs") or [{}]
        sd[0]["files"] = list(moshray_sd_files)
        jobs["moshray"]["file_sd_configs"] = sd[:1]
    if ray_sd_files is not None:
        sd = jobs["ray"].get("file_sd_configs") or [{}]
        sd[0]["files"] = list(ray_sd_files)
        jobs["ray"]["file_sd_configs"] = sd[:1]
    if scrape_interval is not None:
        if not _DURATION.match(scrape_interval):
            raise ValueError(f"scrape interval must look like 5s or 1m, got {scrape_interval!r}")
        config.setdefault("global", {})["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
        for name in ("ray", "moshray"):
            for sd in jobs[name].get("file_sd_configs") or []:
                sd["refresh_interval"] = scrape_interval
    return yaml.safe_dump(config, sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(SHIPPED), help="input prometheus.yml")
    parser.add_argument("--moshray", action="append", help="exporter host:port (repeatable)")
    parser.add_argument("--moshray-sd", action="append",
                        help="job files of the Coordinators (glob; repeatable)")
    parser.add_argument("--ray-sd", action="append", help="Ray service-discovery file")
    parser.add_argument("--interval", help="scrape interval, e.g. 5s")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(render(Path(args.config).read_text(), args.moshray, args.ray_sd,
                                args.interval, args.moshray_sd))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
