"""infra/kuberay/: every manifest is valid against the real CRD schemas, and shaped as moshray
needs it.

Schemas: KubeRay's RayCluster / RayJob and Karpenter's NodePool / EC2NodeClass CRDs, vendored
in tests/data/crds/ (README.md there names each file's source commit), so the test runs
offline. KubeRay's CRDs embed Kubernetes' PodTemplateSpec schema, so the pod specs are checked
against Kubernetes' own types too. A CRD's ``openAPIV3Schema`` is Kubernetes' dialect of JSON
Schema; ``strict_schema`` turns it into plain JSON Schema (draft 4) that rejects what the API
server would not keep:

* ``x-kubernetes-int-or-string: true`` (a quantity, a port): integer or string, as
  ``anyOf: [{type: integer}, {type: string}]`` where the CRD does not spell that out itself;
* unknown fields: the API server prunes them (and ``kubectl apply``'s strict field validation
  rejects them), so an object schema with ``properties`` and neither ``additionalProperties``
  nor ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties: false``. The
  root's ``metadata`` (a bare ``type: object`` in every CRD) gets ObjectMeta's own checks;
* ``nullable: true``: null is allowed; ``format: int32`` / ``int64``: range-checked.

Not checked (only an API server can): the CEL rules (``x-kubernetes-validations``) and
defaulting. A document whose apiVersion and kind no vendored CRD defines fails.

moshray's rules, for every RayCluster and every RayJob's ``rayClusterSpec``: the head never
on spot nodes; every worker group declares ``spot: 1000`` (``rayStartParams.resources``) and
``RAY_NODE_MARKET_TYPE=spot``; token auth on every Ray container (and the autoscaler and the
RayJob submitter); the notice path in each worker pod (the ``moshray-watch`` sidecar runs
``moshray watch --source sigterm --grace-s N`` with N under the pod's grace period, the Ray
container's preStop hook sleeps at least N, ``/tmp/ray`` is one emptyDir shared by both); the
dashboard not on 0.0.0.0. The sidecar's command line is parsed with the real ``moshray`` CLI
parser (Ray is imported, not started).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "infra" / "kuberay"
CRDS = ROOT / "tests" / "data" / "crds"
# libyaml when present: the two KubeRay CRDs are 2.3 MB of YAML (0.4 s instead of 3 s).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

TOKEN_SECRET, TOKEN_KEY = "moshray-ray-token", "token"
SPOT_RESOURCE, SPOT_AMOUNT = "spot", 1000  # cluster/placement.py SPOT_RESOURCE; infra/ray YAMLs
WATCH_CONTAINER = "moshray-watch"
RAY_TMP = "/tmp/ray"
CLOUDS = ("eks", "gke")

# ------------------------------------------------------------------ schemas (pure helpers)

_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# The root metadata of a custom resource: CRDs leave it a bare `type: object`; the API server
# checks it as ObjectMeta. The fields a manifest may set (the rest are the server's).
_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": _DNS1123_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": _DNS1123_SUBDOMAIN},
        "generateName": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "finalizers": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": False,
}
_OPEN_KEYS = ("additionalProperties", "x-kubernetes-preserve-unknown-fields")
_VALUE_VALIDATIONS = ("allOf", "anyOf", "oneOf", "not")


def strict_schema(schema: dict, *, structural: bool = True) -> dict:
    """A copy of a CRD's (OpenAPI v3, Kubernetes-flavoured) schema as draft-4 JSON Schema
    that fails where the API server would drop or refuse a value (module docstring).
    ``structural``: a position that declares fields (not an anyOf/allOf/oneOf/not branch,
    which Kubernetes allows only to narrow values, so it is never closed)."""
    s = {k: v for k, v in schema.items()}
    if s.get("x-kubernetes-int-or-string") and "type" not in s and "anyOf" not in s:
        s["anyOf"] = copy.deepcopy(_INT_OR_STRING)
    if s.get("nullable") and "type" in s:
        s["type"] = [s["type"], "null"] if isinstance(s["type"], str) else [*s["type"], "null"]
        if "enum" in s:
            s["enum"] = [*s["enum"], None]
    if "properties" in s:
        props = {k: strict_schema(v) for k, v in s["properties"].items()}
        if s.get("x-kubernetes-embedded-resource"):  # an embedded object keeps its header
            props.setdefault("apiVersion", {"type": "string"})
            props.setdefault("kind", {"type": "string"})
            props.setdefault("metadata", {"type": "object"})
        s["properties"] = props
        if structural and not any(k in s for k in _OPEN_KEYS):
            s["additionalProperties"] = False
    if isinstance(s.get("items"), dict):
        s["items"] = strict_schema(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = strict_schema(s["additionalProperties"])
    for key in _VALUE_VALIDATIONS:
        if isinstance(s.get(key), list):
            s[key] = [strict_schema(x, structural=False) for x in s[key]]
        elif isinstance(s.get(key), dict):
            s[key] = strict_schema(s[key], structural=False)
    return s


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@functools.lru_cache(maxsize=None)
def _crds() -> dict[tuple[str, str, str], dict]:
    """``{(group, version, kind): openAPIV3Schema}`` of every served version of every CRD
    in tests/data/crds/ (as fetched: not yet strict)."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served", True):
                    key = (spec["group"], version["name"], spec["names"]["kind"])
                    found[key] = version["schema"]["openAPIV3Schema"]
    return found


@functools.lru_cache(maxsize=None)
def _validator(group: str, version: str, kind: str) -> jsonschema.Draft4Validator:
    schema = strict_schema(_crds()[(group, version, kind)])
    schema["properties"]["metadata"] = copy.deepcopy(_OBJECT_META)
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata"})
    return jsonschema.Draft4Validator(schema, format_checker=_FORMATS)


def validator_for(doc: dict) -> jsonschema.Draft4Validator:
    """The strict validator of ``doc``'s apiVersion (group/version) and kind; LookupError if
    no vendored CRD defines them."""
    api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    group, _, version = str(api).rpartition("/")
    if (group, version, kind) not in _crds():
        known = ", ".join(f"{g}/{v} {k}" for g, v, k in sorted(_crds()))
        raise LookupError(f"no vendored CRD schema for apiVersion {api!r} kind {kind!r} "
                          f"(tests/data/crds/ has: {known})")
    return _validator(group, version, kind)


def schema_errors(doc: dict) -> list[str]:
    """Every schema violation of ``doc``, one line each (path: message)."""
    errors = validator_for(doc).iter_errors(doc)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
                  for e in errors)


# ------------------------------------------------------------------------- the manifests

def _load_manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for i, doc in enumerate(yaml.load_all(path.read_text(), Loader=_LOADER)):
            if doc is not None:
                docs.append((f"{path.name}#{i}:{doc.get('kind')}", doc))
    return docs


DOCS = _load_manifests()


def _cluster_specs() -> list[tuple[str, dict, dict]]:
    """``(id, RayClusterSpec, the document)`` of every RayCluster and RayJob."""
    out = []
    for name, doc in DOCS:
        if doc.get("kind") == "RayCluster":
            out.append((name, doc["spec"], doc))
        elif doc.get("kind") == "RayJob":
            out.append((f"{name}.rayClusterSpec", doc["spec"]["rayClusterSpec"], doc))
    return out


CLUSTER_SPECS = _cluster_specs()
_SPEC_IDS = [name for name, _, _ in CLUSTER_SPECS]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", ())}


def _token_auth_problems(where: str, env: dict[str, dict]) -> list[str]:
    problems = []
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        problems.append(f"{where}: RAY_AUTH_MODE is not 'token'")
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    if (ref.get("name"), ref.get("key")) != (TOKEN_SECRET, TOKEN_KEY):
        problems.append(f"{where}: RAY_AUTH_TOKEN is not from Secret {TOKEN_SECRET} "
                        f"key {TOKEN_KEY} (got {ref or 'none'})")
    return problems


def _script(container: dict) -> str:
    """A container's command line as the shell would run it (``sh -c SCRIPT`` unwrapped)."""
    argv = [*container.get("command", ()), *container.get("args", ())]
    if len(argv) >= 3 and argv[0].endswith("sh") and argv[1] in ("-c", "-lc", "-ec"):
        return " ".join(argv[2:])
    return shlex.join(argv)


def _watch_argv(container: dict) -> list[str]:
    """The ``moshray watch ...`` words of the sidecar's command line."""
    script = _script(container)
    match = re.search(r"(?:^|[;&|]\s*|\bexec\s+)(moshray\s+watch\b[^;&|]*)", script)
    assert match, f"{WATCH_CONTAINER} does not run `moshray watch`: {script!r}"
    return shlex.split(match.group(1))


def _option(argv: list[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def _prestop_sleep_s(container: dict) -> float:
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:  # Kubernetes' own sleep action
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command")
    assert command, f"{container['name']}: no preStop hook"
    script = _script({"command": command})
    match = re.fullmatch(r"\s*(?:exec\s+)?sleep\s+(\d+(?:\.\d+)?)\s*", script)
    assert match, f"{container['name']}: preStop is not a plain sleep: {command}"
    return float(match.group(1))


def _mount(container: dict, path: str) -> str | None:
    return next((m["name"] for m in container.get("volumeMounts", ())
                 if m["mountPath"].rstrip("/") == path), None)


def _on_spot(pod: dict) -> bool:
    selector = pod.get("nodeSelector", {})
    return (selector.get("karpenter.sh/capacity-type") == "spot"
            or selector.get("cloud.google.com/gke-spot") == "true")


def _never_on_spot(pod: dict) -> bool:
    """The pod can only land on on-demand nodes: Karpenter's on-demand capacity type, or a
    required node affinity whose every term excludes GKE Spot nodes."""
    selector = pod.get("nodeSelector", {})
    if selector.get("karpenter.sh/capacity-type") == "on-demand":
        return True
    if _on_spot(pod) or selector.get("karpenter.sh/capacity-type"):
        return False
    required = (pod.get("affinity", {}).get("nodeAffinity", {})
                .get("requiredDuringSchedulingIgnoredDuringExecution", {}))
    terms = required.get("nodeSelectorTerms", [])

    def excludes_spot(term: dict) -> bool:
        return any(e["key"] == "cloud.google.com/gke-spot"
                   and (e["operator"] == "DoesNotExist"
                        or (e["operator"] == "NotIn" and "true" in e.get("values", ())))
                   for e in term.get("matchExpressions", ()))

    return bool(terms) and all(excludes_spot(t) for t in terms)


def _ray_start_resources(params: dict) -> dict:
    """``rayStartParams.resources`` as ``ray start --resources`` receives it: KubeRay pastes
    the value into a bash command line (``--resources=VALUE``), so one shell word."""
    raw = params.get("resources")
    assert raw, "rayStartParams has no resources"
    words = shlex.split(raw)
    assert len(words) == 1, f"rayStartParams.resources is not one shell word: {raw!r}"
    return json.loads(words[0])


def _cli_args(argv: list[str]):
    """``argv`` parsed by the real ``moshray`` CLI parser (only the named command's module is
    imported; nothing runs)."""
    from moshray.jobs.cli import build_parser

    try:
        return build_parser(argv).parse_args(argv)
    except SystemExit as exc:  # argparse's way of saying no
        raise AssertionError(f"`moshray {shlex.join(argv)}` does not parse ({exc})") from None


# --------------------------------------------------------------------------------- tests

def test_the_manifests_are_there():
    names = {p.name for p in MANIFESTS.glob("*.yaml")}
    assert {f"raycluster-{c}.yaml" for c in CLOUDS} | {f"rayjob-{c}.yaml" for c in CLOUDS} <= names
    kinds = sorted(doc["kind"] for _, doc in DOCS)
    assert kinds.count("RayCluster") >= 2 and kinds.count("RayJob") >= 2, kinds
    assert {"NodePool", "EC2NodeClass"} <= set(kinds), kinds


@pytest.mark.parametrize("doc", [d for _, d in DOCS], ids=[n for n, _ in DOCS])
def test_each_document_is_valid_against_its_crd(doc):
    assert schema_errors(doc) == []


@pytest.mark.parametrize("_, spec, doc", CLUSTER_SPECS, ids=_SPEC_IDS)
def test_head_is_on_demand_small_and_keeps_the_dashboard_off_0000(_, spec, doc):
    head = spec["headGroupSpec"]
    pod = head["template"]["spec"]
    assert _never_on_spot(pod), f"the head may land on spot nodes: {pod.get('nodeSelector')}"
    tolerated = {t.get("key") for t in pod.get("tolerations", ())}
    assert "cloud.google.com/gke-spot" not in tolerated
    params = head["rayStartParams"]
    assert float(params.get("num-cpus", "inf")) <= 2, "the head's num-cpus is not small"
    # Unset, KubeRay passes --dashboard-host=0.0.0.0 itself (ray-operator/.../common/pod.go).
    host = params.get("dashboard-host")
    assert host and host.strip("'\"") not in ("0.0.0.0", "::", "[::]"), host
    ray = pod["containers"][0]
    env = _env(ray)
    for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", host):
        assert var in env, f"dashboard-host uses ${var}, which the head container does not set"
    uri = env.get("MOSHRAY_CHECKPOINT_URI", {}).get("value", "")
    assert re.fullmatch(r"(s3|gs)://[^/]+/.+", uri), f"MOSHRAY_CHECKPOINT_URI: {uri!r}"


@pytest.mark.parametrize("_, spec, doc", CLUSTER_SPECS, ids=_SPEC_IDS)
def test_workers_are_spot_and_declare_the_spot_resource(_, spec, doc):
    groups = spec["workerGroupSpecs"]
    assert "spot-gpu" in [g["groupName"] for g in groups]
    for group in groups:
        where = group["groupName"]
        assert _ray_start_resources(group["rayStartParams"]) == {SPOT_RESOURCE: SPOT_AMOUNT}, where
        pod = group["template"]["spec"]
        assert _on_spot(pod), f"{where}: not scheduled on spot nodes"
        ray = pod["containers"][0]
        env = _env(ray)
        assert env.get("RAY_NODE_MARKET_TYPE", {}).get("value") == "spot", where
        zone = env.get("RAY_NODE_ZONE", {}).get("valueFrom", {}).get("fieldRef", {})
        assert "topology.kubernetes.io/zone" in zone.get("fieldPath", ""), where
        resources = ray["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory", "nvidia.com/gpu"} <= set(resources[kind]), (where, kind)
        assert int(resources["limits"]["nvidia.com/gpu"]) == 1, where


@pytest.mark.parametrize("_, spec, doc", CLUSTER_SPECS, ids=_SPEC_IDS)
def test_token_auth_on_every_ray_process(_, spec, doc):
    problems = []
    pods = [("head", spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in spec["workerGroupSpecs"]]
    if doc["kind"] == "RayJob" and doc["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode":
        # The submitter's `ray job submit` needs the token as much as the nodes do.
        submitter = doc["spec"].get("submitterPodTemplate")
        assert submitter, "K8sJobMode without a submitterPodTemplate: its pod has no token"
        pods.append(("submitter", submitter["spec"]))
    for where, pod in pods:
        for container in [*pod.get("initContainers", ()), *pod["containers"]]:
            problems += _token_auth_problems(f"{where}/{container['name']}", _env(container))
    if spec.get("enableInTreeAutoscaling"):
        autoscaler_env = {e["name"]: e for e in spec.get("autoscalerOptions", {}).get("env", ())}
        problems += _token_auth_problems("autoscaler", autoscaler_env)
    assert problems == []


@pytest.mark.parametrize("_, spec, doc", CLUSTER_SPECS, ids=_SPEC_IDS)
def test_each_worker_pod_has_the_notice_path(_, spec, doc):
    for group in spec["workerGroupSpecs"]:
        where = group["groupName"]
        pod = group["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds")
        assert isinstance(grace, int) and grace > 0, f"{where}: no terminationGracePeriodSeconds"
        ray, *others = pod["containers"]  # KubeRay runs `ray start` in container 0
        watch = next((c for c in others if c["name"] == WATCH_CONTAINER), None)
        assert watch, f"{where}: no {WATCH_CONTAINER} sidecar"
        assert watch["image"] == ray["image"], f"{where}: the sidecar runs another image"
        argv = _watch_argv(watch)
        args = _cli_args(argv[1:])  # the real parser: the flags exist and take these values
        assert args.source == "sigterm", f"{where}: {shlex.join(argv)}"
        assert args.grace_s is not None and 0 < args.grace_s < grace, (
            f"{where}: --grace-s {args.grace_s} is not under the pod's grace period {grace}")
        sleep_s = _prestop_sleep_s(ray)
        assert args.grace_s <= sleep_s < grace, (
            f"{where}: the Ray container's preStop sleeps {sleep_s} s; the watcher needs "
            f"{args.grace_s} s and the pod has {grace} s")
        shared = _mount(ray, RAY_TMP)
        assert shared and _mount(watch, RAY_TMP) == shared, f"{where}: {RAY_TMP} not shared"
        volume = next(v for v in pod["volumes"] if v["name"] == shared)
        assert "emptyDir" in volume, f"{where}: {RAY_TMP} is not an emptyDir"


@pytest.mark.parametrize("cloud", CLOUDS)
def test_rayjob_runs_the_training_job_on_the_same_cluster(cloud):
    (cluster,) = [d for n, d in DOCS if n.startswith(f"raycluster-{cloud}.yaml")
                  and d["kind"] == "RayCluster"]
    (job,) = [d for n, d in DOCS if n.startswith(f"rayjob-{cloud}.yaml") and d["kind"] == "RayJob"]
    spec = job["spec"]
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    words = shlex.split(spec["entrypoint"])
    if words[:3] == ["python", "-m", "moshray.jobs.train"]:
        words = ["moshray", "train", *words[3:]]
    assert words[:2] == ["moshray", "train"], spec["entrypoint"]
    # (Not parsed with the CLI here: `moshray train`'s parser imports torch, 1.5 s.)
    assert _option(words, "--name"), "the training job has no --name (a retry could not resume)"
    assert spec["rayClusterSpec"] == cluster["spec"], (
        f"rayjob-{cloud}.yaml's rayClusterSpec differs from raycluster-{cloud}.yaml's spec")
    submitter = spec["submitterPodTemplate"]["spec"]
    assert _never_on_spot(submitter), "the submitter pod may land on spot nodes"


def test_eks_nodes_fit_the_pods():
    docs = [d for n, d in DOCS if n.startswith("raycluster-eks.yaml")]
    (node_class,) = [d for d in docs if d["kind"] == "EC2NodeClass"]
    metadata = node_class["spec"]["metadataOptions"]
    assert metadata["httpTokens"] == "required" and metadata["httpPutResponseHopLimit"] == 2
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NodePool"}
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]

    def capacity_types(pool):
        return next(r["values"] for r in pool["spec"]["template"]["spec"]["requirements"]
                    if r["key"] == "karpenter.sh/capacity-type")

    pods = [cluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    for pod in pods:
        selector = pod["nodeSelector"]
        pool = pools[selector["karpenter.sh/nodepool"]]  # a NodePool of this file
        template = pool["spec"]["template"]["spec"]
        assert template["nodeClassRef"]["name"] == node_class["metadata"]["name"]
        assert capacity_types(pool) == [selector["karpenter.sh/capacity-type"]]
        tolerated = {t["key"] for t in pod.get("tolerations", ())}
        assert {t["key"] for t in template.get("taints", ())} <= tolerated
    spot = [p for p in pools.values() if capacity_types(p) == ["spot"]]
    assert spot and all(p["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"
                        for p in spot), "spot GPU nodes with training pods get consolidated"


# ---------------------------------------------------------- the validator really validates

def _raycluster(cloud: str = "eks") -> dict:
    (doc,) = [d for n, d in DOCS if n.startswith(f"raycluster-{cloud}.yaml")
              and d["kind"] == "RayCluster"]
    return copy.deepcopy(doc)


def _broken(change) -> list[str]:
    doc = _raycluster()
    change(doc)
    return schema_errors(doc)


@pytest.mark.parametrize("change, expected", [
    # an unknown field in a KubeRay type
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(bogus=1), "'bogus' was unexpected"),
    # an unknown field in Kubernetes' own Container type (inside the embedded pod template)
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     .update(imagePullPolicyy="Always"), "'imagePullPolicyy' was unexpected"),
    # an unknown top-level field of the resource
    (lambda d: d.update(specs={}), "'specs' was unexpected"),
    # wrong types
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas="two"), "is not of type 'integer'"),
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]
     .update(terminationGracePeriodSeconds="120"), "is not of type 'integer'"),
    (lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 1}),
     "is not of type 'string'"),
    # int-or-string: a list is neither; a malformed quantity string fails its pattern
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].update(cpu=[3]), "is not valid under any of the given schemas"),
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].update(memory="11 GiB"), "does not match"),
    # an enum, a required field, the root metadata
    (lambda d: d["spec"]["autoscalerOptions"].update(upscalingMode="Sometimes"), "is not one of"),
    (lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required"),
    (lambda d: d["metadata"].update(name="Moshray_Cluster"), "does not match"),
    (lambda d: d["metadata"].update(nmae="x"), "'nmae' was unexpected"),
    # format int32
    (lambda d: d["spec"]["workerGroupSpecs"][0].update(maxReplicas=2**31), "is not a 'int32'"),
], ids=["unknown-field", "unknown-container-field", "unknown-root-field", "replicas-string",
        "grace-string", "raystartparam-int", "quantity-list", "quantity-malformed",
        "bad-enum", "missing-required", "bad-name", "unknown-metadata-field", "int32-range"])
def test_invalid_copies_fail(change, expected):
    errors = _broken(change)
    assert errors, "an invalid manifest validated"
    assert any(expected in e for e in errors), errors


def test_int_or_string_takes_both():
    for value in (3, "3", "2500m"):
        doc = _raycluster()
        doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
            "limits"]["cpu"] = value
        assert schema_errors(doc) == [], value


def test_karpenter_documents_are_strict_too():
    pool = copy.deepcopy(next(d for _, d in DOCS if d["kind"] == "NodePool"))
    pool["spec"]["disruption"]["consolidationPolicy"] = "Sometimes"
    pool["spec"]["template"]["spec"]["expireAfter"] = 3600
    pool["spec"]["template"]["spec"]["bogus"] = True
    errors = "\n".join(schema_errors(pool))
    for expected in ("'Sometimes' is not one of", "3600 is not of type 'string'",
                     "'bogus' was unexpected"):
        assert expected in errors, errors
    node_class = copy.deepcopy(next(d for _, d in DOCS if d["kind"] == "EC2NodeClass"))
    node_class["spec"]["metadataOptions"]["httpPutResponseHopLimit"] = 65
    assert any("65 is greater than the maximum" in e for e in schema_errors(node_class))


def test_a_kind_without_a_schema_fails():
    with pytest.raises(LookupError, match="no vendored CRD schema"):
        schema_errors({"apiVersion": "ray.io/v1", "kind": "RayWhatever", "metadata": {"name": "x"}})
    with pytest.raises(LookupError, match="no vendored CRD schema"):
        schema_errors({"apiVersion": "ray.io/v2", "kind": "RayCluster", "metadata": {"name": "x"}})


def test_strict_schema_rules():
    crd_like = {
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True},
            "free": {"type": "object", "properties": {"a": {"type": "string"}},
                     "x-kubernetes-preserve-unknown-fields": True},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
            "bare": {"type": "object"},
            "maybe": {"type": "string", "nullable": True},
        },
        "anyOf": [{"required": ["port"]}, {"properties": {"port": {"type": "string"}}}],
    }
    schema = strict_schema(crd_like)
    assert schema["properties"]["port"]["anyOf"] == _INT_OR_STRING
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["free"]  # preserved unknowns
    assert "additionalProperties" not in schema["properties"]["bare"]  # nothing declared
    assert "additionalProperties" not in schema["anyOf"][1]  # a value validation, not closed
    check = jsonschema.Draft4Validator(schema).is_valid
    assert check({"port": 80}) and check({"port": "http"}) and not check({"port": 1.5})
    assert check({"port": 1, "free": {"a": "x", "b": 2}, "map": {"k": "v"}, "bare": {"z": 1}})
    assert check({"port": 1, "maybe": None}) and not check({"port": 1, "other": 1})
