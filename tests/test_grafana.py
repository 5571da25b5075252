"""The Grafana dashboard: valid JSON, well-formed panels, and only metrics the exporter exports
(plus Ray's own node metrics, as Ray's metrics agent names them).

Metric names are pulled out of each PromQL expression (panel targets and annotations) by
removing strings, label matchers, grouping clauses and range selectors, then keeping the
identifiers that are not functions or keywords. Every name must be one the exporter's
registry produces, and every metric family of the exporter must appear on the dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moshray.cluster.metrics import MetricsExporter

DASHBOARD = Path(__file__).resolve().parents[1] / "infra" / "grafana" / "moshray.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names in one PromQL expression (Grafana variables allowed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\w+", " ", e)  # $__rate_interval and friends (outside ranges)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", e):
        word, call = match.group(1), match.group(2)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) for every query of the dashboard: panels (nested too) and annotations."""
    found = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                found.append((f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for a in dashboard.get("annotations", {}).get("list", []):
        if "expr" in a:
            found.append((f"annotation {a['name']!r}", a["expr"]))
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (le) '
            '(rate(moshray_a_seconds_bucket[$__rate_interval])))'
            ' / on (job) group_left sum(rate(moshray_b_total{outcome="ok", x=~"y.+"}[5m])) * 1e6'
            ' > bool 0 or vector(0)')
    assert metric_names(expr) == {"moshray_a_seconds_bucket", "moshray_b_total"}
    assert metric_names("moshray_peers") == {"moshray_peers"}
    assert metric_names('count by (__name__) ({job="ray"})') == set()


def test_dashboard_is_valid_and_well_formed(dashboard):
    assert dashboard["title"] and dashboard["uid"] == "moshray"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in dashboard["panels"]:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "loss", "peers", "round duration", "expert", "cost"):
        assert topic in titles, f"no panel about {topic}"
    annotations = [a for a in dashboard["annotations"]["list"] if "expr" in a]
    assert any("preemption_notices" in a["expr"] for a in annotations)


def ray_node_metrics() -> set[str]:
    """The node gauges Ray's metrics agent exports, by their Prometheus names."""
    from ray.dashboard.modules.reporter.reporter_agent import METRICS_GAUGES

    return {f"ray_{name}" for name in METRICS_GAUGES}


def test_every_query_names_exported_metrics(dashboard):
    exported = MetricsExporter().metric_names() | ray_node_metrics()
    used: set[str] = set()
    for where, expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{where}: {sorted(unknown)} not exported (query {expr!r})"
        used |= names
    # and the dashboard shows every metric family the exporter has
    families = {f.name for f in MetricsExporter().registry.collect()}
    suffixes = ("", "_total", "_bucket", "_sum", "_count")
    shown = {n for n in families if any(n + s in used for s in suffixes)}
    assert families - shown == set(), f"exported but not on the dashboard: {families - shown}"


def test_node_panels_show_cpu_gpu_and_memory_from_rays_metrics(dashboard):
    used = {name for _, expr in expressions(dashboard) for name in metric_names(expr)}
    for name in ("ray_node_cpu_utilization", "ray_node_gpus_utilization", "ray_node_gram_used",
                 "ray_node_mem_used", "ray_node_mem_total"):
        assert name in used and name in ray_node_metrics(), name
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"CPU per node", "GPU per node", "Memory per node"} <= titles


def test_job_and_run_variables_filter_every_query(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "moshray_" in variables["job"]["query"]["query"] and \
        variables["job"]["query"]["query"].endswith(", job)")
    assert variables["session"]["query"]["query"] == \
        "label_values(ray_node_cpu_utilization, SessionName)"
    for var in ("job", "session"):
        assert variables[var]["includeAll"] and variables[var]["allValue"] == ".*"
    for where, expr in expressions(dashboard):
        # each metric selector carries its filter: moshray's by job, Ray's by session
        for name in metric_names(expr):
            selectors = re.findall(rf"\b{name}(\{{[^}}]*\}})?", expr)
            wanted = 'job=~"$job"' if name.startswith("moshray_") else \
                'SessionName=~"$session"'
            assert all(wanted in s for s in selectors), f"{where}: {name} not filtered"


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_head_points_rays_dashboard_at_prometheus_and_grafana(cloud):
    """Ray's dashboard shows its Metrics tab only with RAY_PROMETHEUS_HOST and
    RAY_GRAFANA_HOST set in the head's environment (ray.env, read by its systemd unit)."""
    bootstrap = DASHBOARD.parents[1] / cloud / "modules" / "bootstrap"
    head = (bootstrap / "templates" / "head.sh.tftpl").read_text()
    env = head.split("cat >/etc/moshray/ray.env <<'ENV'\n", 1)[1].split("\nENV\n", 1)[0]
    assert "RAY_PROMETHEUS_HOST=http://127.0.0.1:${prometheus_port}" in env
    assert "RAY_GRAFANA_HOST=${grafana_host}" in env
    assert "RAY_GRAFANA_IFRAME_HOST=${grafana_iframe_host}" in env
    assert "EnvironmentFile=/etc/moshray/ray.env" in head
    main = (bootstrap / "main.tf").read_text()
    for name in ("prometheus_port", "grafana_host", "grafana_iframe_host"):
        assert f"= var.{name}" in main
        assert f'variable "{name}"' in (bootstrap / "variables.tf").read_text()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_embedded_cluster_serves_rays_dashboard_on_loopback_when_asked():
    """``cluster.dashboard`` (``moshray train --dashboard``): the embedded cluster's head runs
    Ray's dashboard on 127.0.0.1, and its URL answers."""
    import time
    import urllib.request

    import ray

    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    with LocalCluster(LocalClusterConfig(spot_nodes=0, dashboard=True)) as cluster:
        url = cluster.dashboard_url
        assert url is not None and url.startswith("http://127.0.0.1:"), url
        deadline = time.monotonic() + 60
        while True:  # the dashboard process may still be starting its HTTP server
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=5) as answer:
                    version = json.loads(answer.read())
                break
            except OSError:
                assert time.monotonic() < deadline, f"{url} never answered"
                time.sleep(1.0)
    assert version["ray_version"] == ray.__version__
