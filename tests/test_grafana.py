"""The Grafana dashboard: valid JSON, well-formed panels, and only metrics the exporter exports.

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


def test_every_query_names_exported_metrics(dashboard):
    exported = MetricsExporter().metric_names()
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
