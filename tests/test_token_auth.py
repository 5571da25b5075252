"""Ray token authentication on the embedded local cluster (``LocalClusterConfig(token_auth=True)``).

The cluster runs in its own Python process (Ray's auth mode is process-wide state, and this
pytest process may hold a driver connection to the session cluster of tests/conftest.py), all
on 127.0.0.1 with free ports, head only. Against it, from clean client processes whose HOME
holds no ``~/.ray/auth_token``:

* the job API refuses a request without a token (401) and with a wrong one (403), and
  accepts the cluster's token (200);
* ``ray job submit`` without the token is refused; with it, the job is accepted and runs;
* a driver (``ray.init``) without the token is refused by the GCS;
* the cluster's own driver, which has the token, runs a task;
* shutting the cluster down restores the environment and removes the token file.

The cluster process shuts the cluster down when its stdin closes (or on SIGTERM) and then
restores the environment and removes the token file.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from raystart import free_port

pytestmark = pytest.mark.cluster

STARTUP_TIMEOUT_S = 300
JOB_TIMEOUT_S = 240
REFUSAL_TIMEOUT_S = 180

CLUSTER_SCRIPT = r"""
import json, os, signal, sys
from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, head_cpus=1, dashboard=True,
                                          dashboard_port=int(sys.argv[1]), token_auth=True))
try:
    cluster.connect()
    import ray
    answer = ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=120)
    print(json.dumps({"gcs": cluster.address, "dashboard": cluster.dashboard_url,
                      "token_path": cluster.auth_token_path, "answer": answer,
                      "mode": os.environ["RAY_AUTH_MODE"]}), flush=True)
    sys.stdin.read()
finally:
    token_path = cluster.auth_token_path
    cluster.shutdown()
    print(json.dumps({"down": True, "token_file_left": os.path.exists(token_path or ""),
                      "mode_after": os.environ.get("RAY_AUTH_MODE")}), flush=True)
"""


def client_env(home: Path, token_path: str | None = None, token: str | None = None) -> dict:
    """A client's environment: loopback Ray, no token anywhere unless given."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")
    if token_path:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path)
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return env


def read_json_line(proc: subprocess.Popen, timeout: float, log: Path) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("{"):
                return json.loads(line)
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"no answer from the cluster process in {timeout} s; log:\n"
                         f"{log.read_text()[-3000:]}")


def http_status(url: str, token: str | None) -> int:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def get_json(url: str, token: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.fixture
def token_cluster(tmp_path):
    log = tmp_path / "cluster.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CLUSTER_SCRIPT, str(free_port())],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                text=True, env=env, cwd=tmp_path)
    after: list[dict] = []

    def stop() -> dict:
        """Close the cluster process's stdin: it shuts down and reports (idempotent)."""
        if not after:
            proc.stdin.close()
            after.append(read_json_line(proc, 120, log))
            proc.wait(timeout=60)
        return after[0]

    try:
        info = read_json_line(proc, STARTUP_TIMEOUT_S, log)
        info["stop"] = stop
        yield info
        stop()
    finally:
        if proc.poll() is None:  # SIGTERM: the script's handler still shuts the cluster down
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_token_auth_refuses_clients_without_the_token_and_accepts_the_token(token_cluster,
                                                                             tmp_path):
    info = token_cluster
    assert info["mode"] == "token" and info["answer"] == 42  # its own driver has the token
    token_path = info["token_path"]
    assert (os.stat(token_path).st_mode & 0o077) == 0  # readable by this user only
    token = Path(token_path).read_text().strip()
    assert len(token) >= 32
    home = tmp_path / "client-home"
    home.mkdir()

    # A driver without the token: the GCS refuses it (Ray retries first; runs meanwhile).
    driver = subprocess.Popen(
        [sys.executable, "-c",
         f"import ray; ray.init(address={info['gcs']!r}); print('CONNECTED', flush=True)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=client_env(home), cwd=tmp_path)
    try:
        jobs = f"{info['dashboard']}/api/jobs/"
        assert http_status(jobs, None) == 401
        assert http_status(jobs, "0" * len(token)) == 403
        assert http_status(jobs, token) == 200

        submit = ["ray", "job", "submit", "--address", info["dashboard"], "--no-wait", "--",
                  "python", "-c", "print('moshray-token-ok')"]
        refused = subprocess.run(submit, capture_output=True, text=True, timeout=120,
                                 env=client_env(home), cwd=tmp_path)
        assert refused.returncode != 0
        assert "Authentication" in refused.stdout + refused.stderr

        wrong = subprocess.run(submit, capture_output=True, text=True, timeout=120,
                               env=client_env(home, token="f" * len(token)), cwd=tmp_path)
        assert wrong.returncode != 0

        # The job server answers 500 "No available agent" until a node's job agent is up
        # (slow on a loaded 2-core machine): try again, bounded.
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            accepted = subprocess.run(submit, capture_output=True, text=True, timeout=120,
                                      env=client_env(home, token_path=token_path), cwd=tmp_path)
            if accepted.returncode == 0 or "No available agent" not in accepted.stderr or \
                    time.monotonic() > deadline:
                break
            time.sleep(2.0)
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        job_id = re.search(r"raysubmit_\w+", accepted.stdout + accepted.stderr).group(0)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        status = None
        while time.monotonic() < deadline:
            status = get_json(f"{jobs}{job_id}", token)["status"]
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(1.0)
        assert status == "SUCCEEDED", status
        logs = get_json(f"{jobs}{job_id}/logs", token)["logs"]
        assert "moshray-token-ok" in logs

        out, err = driver.communicate(timeout=REFUSAL_TIMEOUT_S)
        assert driver.returncode != 0 and "CONNECTED" not in out
        assert "InvalidAuthToken" in err or "AuthenticationError" in err, err[-2000:]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)

    # Shutdown restores the environment and removes the token file.
    assert info["stop"]() == {"down": True, "token_file_left": False, "mode_after": None}
    assert not os.path.exists(token_path)

