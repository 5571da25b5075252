"""A real Prometheus server scrapes moshray's exporter and Ray's nodes, with the shipped config.

The Debian package ``prometheus`` provides the server (``.ci/run`` installs it; this module
tries to install it when missing and skips, saying why, only if that fails). The server runs
on 127.0.0.1 on a free port with ``infra/prometheus/prometheus.yml`` rendered for this
machine (the Coordinator's exporter address, the path of Ray's service-discovery file, a 1 s
scrape interval), and the test reads what it collected through the HTTP query API.

Ray's service-discovery file is written by Ray's dashboard. When the session cluster runs
without a dashboard, the test runs Ray's own writer (the class the dashboard runs) once, in
a subprocess, into a temporary directory: same code, same file format.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from moshray.cluster import metrics as m
from raystart import free_port

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "infra" / "prometheus" / "prometheus.yml"
SD_FILE = "prom_metrics_service_discovery.json"  # ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def _load_renderer():
    spec = importlib.util.spec_from_file_location(
        "moshray_prometheus_render", ROOT / "infra" / "prometheus" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer().render


def prometheus_binary() -> str:
    """Path of the prometheus binary, installing Debian's package if it is missing."""
    found = shutil.which("prometheus")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.skip("prometheus is not installed and apt-get is not available to install it")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        pytest.skip("prometheus is not installed; installing it needs root or sudo")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in ([apt, "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
                [apt, "update", "-qq"],
                [apt, "install", "-y", "-qq", "--no-install-recommends", "prometheus"]):
        subprocess.run(sudo + cmd, env=env, capture_output=True, timeout=600)
        found = shutil.which("prometheus") or (
            "/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
        if found:
            return found
    pytest.skip("prometheus is not installed and `apt-get install prometheus` failed")


def http_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def query(base: str, promql: str) -> list[dict]:
    """Prometheus instant query; returns the result vector (raises on an API error)."""
    body = http_json(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(base: str, promql: str, timeout_s: float = 90, ok=bool) -> list[dict]:
    """Poll ``promql`` until ``ok(result)``; fails with the last result after the timeout."""
    deadline = time.monotonic() + timeout_s
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = query(base, promql)
        if ok(result):
            return result
        time.sleep(1)
    pytest.fail(f"Prometheus: {promql!r} still {result} after {timeout_s} s")


@contextlib.contextmanager
def prometheus_server(config_text: str, workdir: Path):
    """A Prometheus server on 127.0.0.1 (free port) with ``config_text``; yields its URL."""
    binary = prometheus_binary()
    config = workdir / "prometheus.yml"
    config.write_text(config_text)
    check = subprocess.run([binary, "--version"], capture_output=True, timeout=30)
    assert check.returncode == 0
    for attempt in range(3):  # the free port may be taken by another process meanwhile
        port = free_port()
        log = open(workdir / f"prometheus-{attempt}.log", "wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            if proc.poll() is not None:
                continue  # exited (port taken?): try another port
            yield base
            return
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
            log.close()
    logs = "\n".join(p.read_text(errors="replace")[-1500:]
                     for p in workdir.glob("prometheus-*.log"))
    pytest.fail(f"prometheus did not start:\n{logs}")


def ray_service_discovery_file(local_cluster, workdir: Path) -> Path:
    """Ray's SD file of the session cluster (run Ray's writer once if no dashboard wrote it)."""
    session = Path(local_cluster.cluster.head_node.get_session_dir_path())
    if (session / SD_FILE).exists():
        return session / SD_FILE
    out = workdir / "ray-sd"
    out.mkdir()
    code = ("import sys\n"
            "from ray._private.metrics_agent import PrometheusServiceDiscoveryWriter as W\n"
            "W(sys.argv[1], sys.argv[2], sys.argv[2]).write()\n")
    proc = subprocess.run([sys.executable, "-c", code, local_cluster.address, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / SD_FILE


def dashboard_expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel query of the Grafana dashboard, and its annotations."""
    found = [(f"panel {p['title']!r} {t['refId']}", t["expr"])
             for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [(f"annotation {a['name']!r}", a["expr"])
              for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


def test_renderer_keeps_the_shipped_structure():
    import yaml

    shipped = yaml.safe_load(SHIPPED.read_text())
    jobs = {j["job_name"]: j for j in shipped["scrape_configs"]}
    # every job's Coordinator announces its exporter in a file; its series keep job=<name>
    assert jobs["moshray"]["file_sd_configs"][0]["files"] == ["/tmp/moshray/prometheus/*.json"]
    assert jobs["moshray"]["honor_labels"] is True
    assert jobs["ray"]["file_sd_configs"][0]["files"] == [f"/tmp/ray/{SD_FILE}"]
    out = yaml.safe_load(render(SHIPPED.read_text(), ["127.0.0.1:1234"], ["/x/sd.json"], "2s"))
    jobs = {j["job_name"]: j for j in out["scrape_configs"]}
    assert jobs["moshray"]["static_configs"] == [{"targets": ["127.0.0.1:1234"]}]
    assert "file_sd_configs" not in jobs["moshray"]
    assert jobs["ray"]["file_sd_configs"][0]["files"] == ["/x/sd.json"]
    assert out["global"]["scrape_interval"] == "2s"
    out = yaml.safe_load(render(SHIPPED.read_text(), moshray_sd_files=["/y/*.json"]))
    jobs = {j["job_name"]: j for j in out["scrape_configs"]}
    assert jobs["moshray"]["file_sd_configs"][0]["files"] == ["/y/*.json"]
    with pytest.raises(ValueError, match="host:port"):
        render(SHIPPED.read_text(), ["no-port"])
    with pytest.raises(ValueError, match="no scrape job named 'ray'"):
        render("scrape_configs:\n  - job_name: moshray\n")


def test_shipped_config_passes_promtool(tmp_path: Path):
    prometheus_binary()
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    if not os.path.exists(promtool):
        pytest.skip("promtool is not installed (Debian ships it with prometheus)")
    for text in (SHIPPED.read_text(),
                 render(SHIPPED.read_text(), ["127.0.0.1:9"], [str(tmp_path / SD_FILE)], "1s")):
        config = tmp_path / "p.yml"
        config.write_text(text)
        proc = subprocess.run([promtool, "check", "config", str(config)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_scrapes_moshray_and_ray(local_cluster, tmp_path: Path):
    """Two jobs' Coordinators side by side: Prometheus finds each through the file it
    writes, and every series of each carries its job's name."""
    import ray

    import moshray.cluster.coordinator.actor as coord
    from moshray.cluster.coordinator.progress import ProgressReport

    job, other = f"prom-a-{time.time_ns()}", f"prom-b-{time.time_ns()}"
    c = coord.get_or_create(target_batch_size=16, name=f"prom-test-{job}", metrics_port=0,
                            job=job)
    c2 = coord.get_or_create(target_batch_size=16, name=f"prom-test-{other}", metrics_port=0,
                             job=other)
    try:
        address = ray.get(c.metrics_address.remote(), timeout=60)
        other_address = ray.get(c2.metrics_address.remote(), timeout=60)
        # the Coordinators run on the head: this machine, where Prometheus runs
        files = [coord.sd_file(job), coord.sd_file(other)]
        assert json.loads(Path(files[0]).read_text()) == \
            [{"targets": [address], "labels": {"job": job}}]
        # a short job: two peers commit global steps, report rounds and a preemption
        for i in range(2):
            ray.get(c.register.remote(f"p{i}", None, f"node-{i}"), timeout=30)
            assert ray.get(c.mark_ready.remote(f"p{i}", 0), timeout=30)
        for epoch in range(3):
            for i in range(2):
                ray.get(c.report.remote(ProgressReport(f"p{i}", epoch, 8, loss=3.0 - epoch)),
                        timeout=30)
            ray.get(c.record.remote((m.RoundEvent(0.05 * (epoch + 1), 1 << 20),
                                     m.RoundEvent(0.07, 1 << 20, (("late", 1),), True))),
                    timeout=30)
        ray.get(c.record.remote((m.NoticeEvent("simulated", "local"),
                                 m.NodeLostEvent(with_notice=True),
                                 m.CapacityEvent(spot_nodes=len(local_cluster.live_slots()),
                                                 on_demand_nodes=0))), timeout=30)

        sd_file = ray_service_discovery_file(local_cluster, tmp_path)
        ray_targets = json.loads(sd_file.read_text())[0]["targets"]
        assert ray_targets, "Ray's service-discovery file lists no node"
        config = render(SHIPPED.read_text(), None, [str(sd_file)], "1s", files)
        with prometheus_server(config, tmp_path) as base:
            up = wait_for(base, f'up{{job="{job}"}} == 1')
            assert up[0]["metric"]["instance"] == address
            assert wait_for(base, f'up{{job="{other}"}} == 1')[0]["metric"]["instance"] \
                == other_address
            step = wait_for(base, f'moshray_global_step{{job="{job}"}} >= 2')
            assert float(step[0]["value"][1]) >= 2
            assert float(query(base, f'moshray_global_step{{job="{other}"}}')[0]["value"][1]) \
                == 0
            rounds = wait_for(base, f'moshray_allreduce_round_duration_seconds_count{{job="{job}"}}')
            assert float(rounds[0]["value"][1]) == 6
            late = query(base, f'moshray_allreduce_rejected_contributions_total{{job="{job}",'
                                f'reason="late"}}')
            assert float(late[0]["value"][1]) == 3
            assert float(query(base, f'moshray_training_loss{{job="{job}"}}')[0]["value"][1]) == \
                pytest.approx(1.0)
            lost = query(base, f'moshray_nodes_lost_total{{job="{job}",notice="true"}}')
            assert float(lost[0]["value"][1]) == 1
            spot = query(base, f'moshray_nodes{{job="{job}",market="spot"}}')
            assert float(spot[0]["value"][1]) == len(local_cluster.live_slots())
            # Ray's own metrics, scraped from the nodes listed in the discovery file
            ray_up = wait_for(base, 'up{job="ray"} == 1')
            assert {r["metric"]["instance"] for r in ray_up} <= set(ray_targets)
            names = wait_for(base, 'count by (__name__) ({job="ray", __name__=~"ray_.+"})')
            assert any(r["metric"]["__name__"].startswith("ray_") for r in names)
            # more rounds while Prometheus watches, so that rate() panels have data
            ray.get(c.record.remote((m.RoundEvent(0.3, 1 << 20),)), timeout=30)
            wait_for(base, "rate(moshray_allreduce_round_duration_seconds_count[1m]) > 0")
            # every query of the Grafana dashboard evaluates on this server
            dashboard = json.loads((ROOT / "infra" / "grafana" / "moshray.json").read_text())
            # as Grafana sends them: each variable at its "All" value, the rate interval 1m
            values = {v["name"]: v["allValue"] for v in dashboard["templating"]["list"]
                      if "allValue" in v}
            with_data = set()
            for where, expr in dashboard_expressions(dashboard):
                expr = expr.replace("$__rate_interval", "1m")
                for name, value in values.items():
                    expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
                result = query(base, expr)
                if result:
                    with_data.add(where)
            for title in ("Throughput", "Training loss", "Peers and nodes", "Round duration",
                          "Bytes sent", "Rejections and failed rounds", "Notices and lost nodes",
                          "Cost"):
                assert f"panel {title!r} A" in with_data, f"{title}: no data"
    finally:
        for handle in (c, c2):
            coord.remove(handle)  # its job file too
    assert not any(os.path.exists(f) for f in files)
