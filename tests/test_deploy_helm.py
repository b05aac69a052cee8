"""helm/pagerail renders, lints and validates offline (Helm's own library via helm-python-sdk, no binary)."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.requirements import require_module

helm = require_module("helm_python", "needs helm-python-sdk (Helm's library, bundled)")
kubernetes_validate = require_module("kubernetes_validate", "needs kubernetes-validate")
jsonschema = require_module("jsonschema", "needs jsonschema")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "pagerail"
EXAMPLES = {path.stem: path for path in sorted((CHART / "examples").glob("*.yaml"))}
CASES = ["default", *EXAMPLES]
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the one Helm renders for offline.
KUBE_VERSIONS = ["1.27.0", "1.36.0"]
RELEASE, NAMESPACE = "llm", "serving"
FULLNAME = f"{RELEASE}-pagerail"


def values_of(case: str) -> dict:
    return {} if case == "default" else yaml.safe_load(EXAMPLES[case].read_text())


def render(values: dict | None) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


@cache
def _objects(case: str) -> tuple[dict, ...]:
    return tuple(objects_of(render(values_of(case))))


def objects(case: str) -> list[dict]:
    return copy.deepcopy(list(_objects(case)))


def objects_of(manifests: dict[str, str]) -> list[dict]:
    return [
        document
        for path, text in sorted(manifests.items())
        if not path.endswith("NOTES.txt")
        for document in yaml.safe_load_all(text)
        if document
    ]


def find(items: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [item for item in items if item["kind"] == kind and (name is None or item["metadata"]["name"] == name)]
    assert len(matches) == 1, f"{kind} {name}: {[item['metadata']['name'] for item in matches]}"
    return matches[0]


def kinds(items: list[dict]) -> list[str]:
    return sorted(item["kind"] for item in items)


def container(pod_spec: dict, name: str) -> dict:
    return next(item for item in pod_spec["containers"] if item["name"] == name)


def env_of(spec: dict) -> dict[str, dict]:
    return {item["name"]: item for item in spec.get("env", [])}


def serve_args(items: list[dict]) -> list[str]:
    return pod_specs(items)["head"]["containers"][0]["args"]


def pod_specs(items: list[dict]) -> dict[str, dict]:
    """The head's and the workers' pod specs, from the StatefulSets or from the RayCluster."""
    clusters = [item for item in items if item["kind"] == "RayCluster"]
    if clusters:
        spec = clusters[0]["spec"]
        return {
            "head": spec["headGroupSpec"]["template"]["spec"],
            "worker": spec["workerGroupSpecs"][0]["template"]["spec"],
        }
    return {
        "head": find(items, "StatefulSet", f"{FULLNAME}-head")["spec"]["template"]["spec"],
        "worker": find(items, "StatefulSet", f"{FULLNAME}-worker")["spec"]["template"]["spec"],
    }


# --- the files ------------------------------------------------------------------------------------------


def test_examples_cover_the_documented_setups():
    assert set(EXAMPLES) >= {"tp8-one-node", "two-nodes-tp2", "existing-secret", "kuberay"}


def test_values_yaml_and_schema_describe_the_same_keys():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def paths(schema_node: dict, value: object, prefix: str) -> None:
        if "$ref" in schema_node or "properties" not in schema_node:
            return
        assert isinstance(value, dict), prefix
        assert set(schema_node["properties"]) == set(value), f"{prefix or 'top level'}: schema vs values.yaml"
        for key, child in schema_node["properties"].items():
            assert child.get("description"), f"{prefix}{key} has no description"
            paths(child, value[key], f"{prefix}{key}.")

    paths(schema, values, "")


def test_readme_values_table_is_generated_from_the_schema():
    spec = importlib.util.spec_from_file_location("values_table", ROOT / "helm" / "values_table.py")
    values_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(values_table)
    readme = (ROOT / "README.md").read_text()
    assert values_table.readme_with_table(readme) == readme, "run: python helm/values_table.py"
    # And so it lists exactly the schema's top-level keys.
    table = readme.split(values_table.START)[1].split(values_table.END)[0]
    listed = {line.split("`")[1].split(".")[0] for line in table.splitlines() if line.startswith("| `")}
    assert listed == set(json.loads((CHART / "values.schema.json").read_text())["properties"])


# --- lint and schema ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_clean(case):
    report = helm.lint(CHART, values_of(case), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Helm's only remark is informational: Chart.yaml has no icon.
    assert [message for message in report["messages"] if message["severity"] >= 2] == []


@pytest.mark.parametrize("case", CASES)
def test_values_validate_against_the_schema(case):
    schema = json.loads((CHART / "values.schema.json").read_text())
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values_of(case))
        merged = chart.merge_values(values_of(case))
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(merged)


WRONG_VALUES = {
    "unknown top-level key": {"replicaCount": 2},
    "unknown nested key": {"serve": {"tensorParalelSize": 2}},
    "tensor parallel 0": {"serve": {"tensorParallelSize": 0}},
    "tensor parallel as text": {"serve": {"tensorParallelSize": "2"}},
    "unknown placement": {"serve": {"placementStrategy": "RANDOM"}},
    "negative GPUs": {"worker": {"gpus": -1}},
    "shm not a quantity": {"worker": {"shmSize": "lots"}},
    "unknown cache type": {"modelCache": {"type": "nfs"}},
    "sampling ratio above 1": {"tracing": {"samplingRatio": 1.5}},
    "utilisation above 1": {"serve": {"gpuMemoryUtilization": 1.2}},
    "unknown service type": {"service": {"type": "ExternalName"}},
    "bad secret name": {"apiKey": {"existingSecret": "Not_A_Name"}},
    "data parallel 0": {"serve": {"dataParallelSize": 0}},
    "data parallel as other text": {"serve": {"dataParallelSize": "all"}},
    "unknown routing policy": {"serve": {"routingPolicy": "random"}},
    "max replicas 0": {"serve": {"maxReplicas": 0}},
    "waiting target 0": {"serve": {"targetWaitingPerReplica": 0}},
}


@pytest.mark.parametrize("values", WRONG_VALUES.values(), ids=WRONG_VALUES)
def test_wrong_values_are_rejected(values):
    schema = json.loads((CHART / "values.schema.json").read_text())
    with helm.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(merged)


INCONSISTENT_VALUES = {
    "more ranks than GPUs": ({"serve": {"tensorParallelSize": 4}}, "needs 4 GPUs"),
    "STRICT_PACK across pods": (
        {"serve": {"tensorParallelSize": 2, "placementStrategy": "STRICT_PACK"}, "worker": {"replicas": 2}},
        "STRICT_PACK",
    ),
    "STRICT_SPREAD with too few pods": (
        {"serve": {"tensorParallelSize": 2, "placementStrategy": "STRICT_SPREAD"}, "worker": {"gpus": 2}},
        "STRICT_SPREAD",
    ),
    "more replicas than GPUs": ({"serve": {"dataParallelSize": 2}}, "needs 2 GPUs"),
    "replicas outside their bounds": (
        {"serve": {"dataParallelSize": 2, "maxReplicas": 1}, "worker": {"replicas": 2}},
        "must lie between",
    ),
    "two API keys": ({"apiKey": {"value": "sk-1", "existingSecret": "keys"}}, "not both"),
    "KubeRay with per-pod claims": ({"kuberay": {"enabled": True}}, "existingClaim"),
}


@pytest.mark.parametrize("values,reason", INCONSISTENT_VALUES.values(), ids=INCONSISTENT_VALUES)
def test_inconsistent_values_stop_the_render_with_a_reason(values, reason):
    with pytest.raises(helm.HelmRenderError, match=reason):
        render(values)


# --- every rendered object is valid Kubernetes ----------------------------------------------------------

CUSTOM_GROUPS = ("ray.io/", "monitoring.coreos.com/")


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_validate_strictly(case, kube_version):
    items = objects(case)
    assert items
    for item in items:
        if item["apiVersion"].startswith(CUSTOM_GROUPS):
            continue
        kubernetes_validate.validate(item, kube_version, strict=True)
    # Custom resources have no schema here; their pod templates are plain Kubernetes and are checked as such.
    for item in items:
        if item["kind"] == "RayCluster":
            spec = item["spec"]
            templates = [spec["headGroupSpec"]["template"]] + [group["template"] for group in spec["workerGroupSpecs"]]
            for template in templates:
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": template,
                }
                kubernetes_validate.validate(pod_template, kube_version, strict=True)


def test_strict_validation_would_catch_a_misspelt_field():
    statefulset = find(objects("default"), "StatefulSet", f"{FULLNAME}-worker")
    statefulset["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBE_VERSIONS[-1], strict=True)


# --- key fields -----------------------------------------------------------------------------------------


def test_default_release_objects():
    assert kinds(objects("default")) == sorted(
        [
            "Secret",
            "Service",
            "Service",
            "Service",
            "ServiceAccount",
            "StatefulSet",
            "StatefulSet",
            "PodDisruptionBudget",
        ]
    )


def test_worker_pods_ask_for_gpus_and_join_the_head():
    items = objects("default")
    worker = find(items, "StatefulSet", f"{FULLNAME}-worker")
    assert worker["spec"]["replicas"] == 1 and worker["spec"]["podManagementPolicy"] == "Parallel"
    pod = worker["spec"]["template"]["spec"]
    ray_worker = container(pod, "ray-worker")
    assert ray_worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    script = ray_worker["command"][-1]
    assert f"head={FULLNAME}-ray-head" in script
    assert "exec ray start --address=$head:6379 --num-gpus=1" in script and "--block" in script
    head = find(items, "StatefulSet", f"{FULLNAME}-head")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in container(head, "ray-head")["resources"].get("limits", {})


def test_every_pod_has_a_memory_backed_bounded_dev_shm():
    for case in CASES:
        for role, pod in pod_specs(objects(case)).items():
            shm = next(volume for volume in pod["volumes"] if volume["name"] == "dshm")
            assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"], (case, role)
            mounts = {mount["name"]: mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
            assert mounts["dshm"] == "/dev/shm", (case, role)


def test_head_probes_ready_health_and_native_grpc():
    head = container(pod_specs(objects("default"))["head"], "ray-head")
    assert head["startupProbe"]["grpc"] == {"port": 50051}
    # Half an hour for the first download before the container is restarted.
    assert head["startupProbe"]["periodSeconds"] * head["startupProbe"]["failureThreshold"] >= 1800
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    ports = {port["name"]: port["containerPort"] for port in head["ports"]}
    assert ports == {"http": 8000, "grpc": 50051, "gcs-server": 6379, "dashboard": 8265, "client": 10001}
    http_startup = container(
        pod_specs(objects_of(render({"probes": {"startup": {"type": "http"}}})))["head"], "ray-head"
    )
    assert http_startup["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_head_starts_ray_then_execs_serve_with_the_flags_of_values():
    items = objects("default")
    head = container(pod_specs(items)["head"], "ray-head")
    assert head["command"][:5] == ["tini", "--", "/bin/bash", "-c", head["command"][4]]
    script = head["command"][4]
    assert "ray start --head --port=6379" in script and "--num-gpus=0" in script
    assert script.rstrip().endswith('exec pagerail serve "$@"'), "exec: serve itself gets SIGTERM and drains"
    args = serve_args(items)
    assert args[args.index("--ray-address") + 1] == "auto"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--device") + 1] == "cuda"
    pod = pod_specs(items)["head"]
    assert pod["terminationGracePeriodSeconds"] == 30 + 30, "drain timeout plus margin"


def _serve_parser() -> argparse.ArgumentParser:
    from pagerail.cluster.entrypoints.serve import add_serve_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return parser


@pytest.mark.parametrize("case", CASES)
def test_serve_flags_are_ones_pagerail_serve_accepts(case):
    # Parsed by the real `pagerail serve` parser: a renamed flag fails here, not in a crash-looping pod.
    parsed = _serve_parser().parse_args(serve_args(objects(case)))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for section, overrides in values_of(case).items():
        if isinstance(overrides, dict) and isinstance(values.get(section), dict):
            values[section].update(overrides)
    assert parsed.tensor_parallel_size == values["serve"]["tensorParallelSize"]
    assert parsed.placement_strategy == values["serve"]["placementStrategy"]
    assert parsed.model == (values["model"]["name"] or None)
    assert parsed.port == 8000 and parsed.grpc_port == 50051 and parsed.ray_address == "auto"


def test_tracing_and_limits_reach_serve():
    values = {
        "tracing": {"otlpEndpoint": "http://collector:4317", "samplingRatio": 0.25},
        "serve": {"maxModelLen": 8192, "maxWaitingRequests": 64, "extraArgs": ["--block-size", "32"]},
        "model": {"name": "org/My Model", "servedModelName": "mine"},
    }
    args = serve_args(objects_of(render(values)))
    parsed = _serve_parser().parse_args(args)
    assert parsed.otlp_traces_endpoint == "http://collector:4317" and parsed.trace_sampling_ratio == 0.25
    assert parsed.max_model_len == 8192 and parsed.max_waiting_requests == 64 and parsed.block_size == 32
    # A name with a space stays one argument: the flags reach serve as "$@", never through a shell string.
    assert parsed.model == "org/My Model" and parsed.served_model_name == "mine"
    assert shlex.join(args)  # every argument is a plain string


def test_services_expose_http_grpc_and_rays_ports():
    items = objects("default")
    api = find(items, "Service", FULLNAME)
    assert {port["name"]: port["port"] for port in api["spec"]["ports"]} == {"http": 8000, "grpc": 50051}
    assert api["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    ray_head = find(items, "Service", f"{FULLNAME}-ray-head")
    assert {port["name"]: port["port"] for port in ray_head["spec"]["ports"]} == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
    }
    # The head is ready only after the workers joined it through this Service: it must not wait for readiness.
    assert ray_head["spec"]["publishNotReadyAddresses"] is True
    assert find(items, "StatefulSet", f"{FULLNAME}-head")["spec"]["serviceName"] == f"{FULLNAME}-ray-head"


def test_ray_token_reaches_every_ray_container_from_a_secret():
    items = objects("default")
    secret = find(items, "Secret", f"{FULLNAME}-ray-token")
    assert set(secret["data"]) == {"token"}
    for role, pod in pod_specs(items).items():
        env = env_of(pod["containers"][0])
        assert env["RAY_AUTH_MODE"]["value"] == "token", role
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-ray-token", "key": "token"}
        assert env["PAGERAIL_CACHE_DIR"]["value"] == "/cache"
    without = objects_of(render({"ray": {"auth": {"enabled": False}}}))
    assert not [item for item in without if item["kind"] == "Secret"]
    assert "RAY_AUTH_TOKEN" not in env_of(pod_specs(without)["head"]["containers"][0])


def test_api_key_from_values_is_stored_in_a_secret():
    items = objects_of(render({"apiKey": {"value": "sk-test"}}))
    secret = find(items, "Secret", f"{FULLNAME}-api-key")
    assert secret["data"] == {"api-key": "c2stdGVzdA=="}
    head = pod_specs(items)["head"]["containers"][0]
    assert env_of(head)["PAGERAIL_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-api-key",
        "key": "api-key",
    }
    assert "sk-test" not in json.dumps(pod_specs(items)), "the key itself never sits in a pod spec"
    assert "PAGERAIL_API_KEY" not in env_of(pod_specs(objects("default"))["head"]["containers"][0])


def test_api_key_and_ray_token_from_existing_secrets():
    items = objects("existing-secret")
    assert not [item for item in items if item["kind"] == "Secret"], "existing Secrets are referenced, not made"
    head = env_of(pod_specs(items)["head"]["containers"][0])
    assert head["PAGERAIL_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "pagerail-api", "key": "key"}
    assert head["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "pagerail-ray", "key": "token"}
    assert find(items, "Service", FULLNAME)["spec"]["type"] == "LoadBalancer"
    monitor = find(items, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= find(items, "Service", FULLNAME)["metadata"]["labels"].items()
    )
    dashboard = find(items, "ConfigMap", f"{FULLNAME}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (CHART / "dashboards" / "pagerail-dashboard.json").read_text()
    assert json.loads(dashboard["data"]["pagerail-dashboard.json"]) == json.loads(shipped)


def test_data_parallel_replicas_reach_serve():
    items = objects("data-parallel")
    parsed = _serve_parser().parse_args(serve_args(items))
    assert parsed.data_parallel_size == "2" and parsed.tensor_parallel_size == 2
    assert parsed.routing_policy == "prefix-aware"
    assert (parsed.min_replicas, parsed.max_replicas, parsed.target_waiting_per_replica) == (2, 3, 8)
    # Flags pagerail serve accepts together: the count lies within the bounds.
    from pagerail.cluster.entrypoints.serve import check_replica_flags

    check_replica_flags(parsed)
    notes = render(values_of("data-parallel"))["pagerail/templates/NOTES.txt"]
    assert "Replicas:          2 (prefix-aware routing, scaling 2 to 3)" in notes
    defaults = _serve_parser().parse_args(serve_args(objects("default")))
    assert defaults.data_parallel_size == "1" and (defaults.min_replicas, defaults.max_replicas) == (None, None)
    auto = _serve_parser().parse_args(serve_args(objects_of(render({"serve": {"dataParallelSize": "auto"}}))))
    assert auto.data_parallel_size == "auto"


def test_tp8_on_one_node():
    items = objects("tp8-one-node")
    worker = find(items, "StatefulSet", f"{FULLNAME}-worker")
    assert worker["spec"]["replicas"] == 1
    pod = worker["spec"]["template"]["spec"]
    assert container(pod, "ray-worker")["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    args = serve_args(items)
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--placement-strategy") + 1] == "STRICT_PACK"
    claim = worker["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "model-cache" and claim["spec"]["resources"]["requests"]["storage"] == "200Gi"


def test_two_worker_nodes_with_tensor_parallel_2():
    items = objects("two-nodes-tp2")
    worker = find(items, "StatefulSet", f"{FULLNAME}-worker")
    assert worker["spec"]["replicas"] == 2
    pod = worker["spec"]["template"]["spec"]
    assert container(pod, "ray-worker")["resources"]["limits"]["nvidia.com/gpu"] == 1
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    args = serve_args(items)
    assert args[args.index("--placement-strategy") + 1] == "STRICT_SPREAD"


def test_kuberay_mode_renders_a_raycluster_instead_of_statefulsets():
    items = objects("kuberay")
    assert "StatefulSet" not in kinds(items)
    cluster = find(items, "RayCluster", FULLNAME)
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    pods = pod_specs(items)
    assert "$KUBERAY_GEN_RAY_START_CMD" in pods["worker"]["containers"][0]["command"][-1]
    assert pods["worker"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    head = pods["head"]["containers"][0]
    assert head["readinessProbe"]["httpGet"]["path"] == "/ready" and head["startupProbe"]["grpc"]["port"] == 50051
    group = cluster["spec"]["workerGroupSpecs"][0]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    # KubeRay builds the workers' `ray start`; the object store must stay as small as in the plain mode.
    assert group["rayStartParams"] == {"object-store-memory": "1073741824"}
    # The clients' Service finds the head by the labels KubeRay gives it.
    selector = find(items, "Service", FULLNAME)["spec"]["selector"]
    assert selector == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    cache_volume = next(volume for volume in pods["worker"]["volumes"] if volume["name"] == "model-cache")
    assert cache_volume["hostPath"]["path"] == "/var/cache/pagerail"


def test_disruption_budget_covers_the_release():
    budget = find(objects("default"), "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pagerail",
        "app.kubernetes.io/instance": RELEASE,
    }
    assert not [
        item
        for item in objects_of(render({"podDisruptionBudget": {"enabled": False}}))
        if item["kind"] == "PodDisruptionBudget"
    ]


def test_cache_volume_kinds():
    shared = pod_specs(objects_of(render({"modelCache": {"pvc": {"existingClaim": "models"}}})))
    for pod in shared.values():
        volume = next(volume for volume in pod["volumes"] if volume["name"] == "model-cache")
        assert volume["persistentVolumeClaim"] == {"claimName": "models"}
    empty = pod_specs(objects_of(render({"modelCache": {"type": "emptyDir"}})))
    assert next(v for v in empty["worker"]["volumes"] if v["name"] == "model-cache")["emptyDir"] == {
        "sizeLimit": "100Gi"
    }


def test_notes_tell_how_to_reach_the_api():
    notes = render({})["pagerail/templates/NOTES.txt"]
    assert f"port-forward svc/{FULLNAME} 8000:8000 50051:50051" in notes
    assert "WARNING: no API key" in notes
    with_key = render({"apiKey": {"existingSecret": "keys", "existingSecretKey": "k"}})["pagerail/templates/NOTES.txt"]
    assert "WARNING" not in with_key and "Secret keys, key k" in with_key
