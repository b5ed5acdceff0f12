"""deploy/: every kustomization renders (`kubectl kustomize`) to objects that are valid
Kubernetes and that agree with the server (health service names, ports, grace period,
configuration, the gauges autoscaling reads); the KEDA overlay swaps the HPA for a
ScaledObject and changes nothing else; the vLLM overlay runs --engine vllm over as many
GPUs as its tensor-parallel size, with shared memory and a longer start, and is
otherwise base."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    CRD_KINDS,
    GRPC_PORT,
    HPA_WORKLOADS,
    KUSTOMIZATIONS,
    LIVENESS_SERVICE,
    METRICS_PORT,
    READINESS_SERVICE,
    REPO,
    WORKLOADS,
    config_fields,
    container_env,
    kustomize,
    only,
    pod_containers,
    pod_spec,
    promql_metric_names,
    server_config_from_env,
    server_container,
    server_gauges,
    tokenwire_env,
)

# The oldest Kubernetes these manifests target (native gRPC probes are GA since 1.27)
# and the newest whose schemas kubernetes-validate ships: both offline.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
ALL = list(KUSTOMIZATIONS)
Objects = list[dict[str, Any]]
WORKLOAD_KINDS = {"Deployment", "Service", "PodDisruptionBudget"}
EXPECTED_KINDS = {
    "base": WORKLOAD_KINDS | {"HorizontalPodAutoscaler"},
    "cpu": WORKLOAD_KINDS | {"HorizontalPodAutoscaler"},
    "keda": WORKLOAD_KINDS | {"ScaledObject"},
    "vllm": WORKLOAD_KINDS | {"HorizontalPodAutoscaler"},
    "monitoring": {"ConfigMap", "PrometheusRule", "ServiceMonitor"},
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def test_every_kustomization_is_tested() -> None:
    assert set(EXPECTED_KINDS) == set(KUSTOMIZATIONS)
    on_disk = {path.parent for path in (REPO / "deploy").rglob("kustomization.yaml")}
    assert on_disk == set(KUSTOMIZATIONS.values()), "add the new kustomization to KUSTOMIZATIONS"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", ALL)
def test_every_object_is_valid_kubernetes(rendered: dict[str, Objects], name: str, version: str) -> None:
    """Core kinds against the API's schemas (strict: no unknown fields); CRD kinds are checked below."""
    validated = 0
    for obj in rendered[name]:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        validated += 1
    assert validated > 0
    assert {obj["kind"] for obj in rendered[name]} == EXPECTED_KINDS[name]
    keys = [(obj["kind"], obj["metadata"]["name"]) for obj in rendered[name]]
    assert len(keys) == len(set(keys)), f"duplicate objects: {keys}"


@pytest.mark.parametrize("name", ["keda", "monitoring"])
def test_custom_resources_are_well_formed(rendered: dict[str, Objects], name: str) -> None:
    """kubernetes-validate has no schema for CRD kinds: the shape every custom resource shares
    (what each kind's operator reads: test_monitoring.py and the KEDA tests below)."""
    crd_kinds = {kind for _, kind in CRD_KINDS}
    custom = [obj for obj in rendered[name] if obj["kind"] in crd_kinds]
    expected = EXPECTED_KINDS[name] & crd_kinds
    assert expected and {obj["kind"] for obj in custom} == expected
    for obj in custom:
        assert (obj["apiVersion"], obj["kind"]) in CRD_KINDS, f"{obj['kind']}: unexpected {obj['apiVersion']}"
        assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj["kind"]
        assert set(obj["metadata"]) <= {"name", "namespace", "labels", "annotations"}, obj["metadata"]
        assert DNS_LABEL.match(obj["metadata"]["name"]), obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "tokenwire"
        assert isinstance(obj["spec"], dict) and obj["spec"], f"{obj['kind']}: empty spec"


@pytest.mark.parametrize("name", WORKLOADS)
def test_probes_use_the_servers_health_services(rendered: dict[str, Objects], name: str) -> None:
    container = server_container(rendered[name])
    probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"].get("service", "") == LIVENESS_SERVICE
    # Startup waits for readiness (model loaded and warmed), so liveness starts after the load.
    assert probes["startupProbe"]["service"] == READINESS_SERVICE
    assert probes["readinessProbe"]["service"] == READINESS_SERVICE
    assert {probe["port"] for probe in probes.values()} == {GRPC_PORT}


@pytest.mark.parametrize("name", WORKLOADS)
def test_startup_probe_allows_a_model_load(rendered: dict[str, Objects], name: str) -> None:
    budget = _startup_budget_s(server_container(rendered[name]))
    assert budget >= 180, f"startupProbe gives the model {budget} s to load"


@pytest.mark.parametrize("name", WORKLOADS)
def test_ports_match_the_server(rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = rendered[name]
    container = server_container(objects)
    config = server_config_from_env(tokenwire_env(container_env(container)), monkeypatch)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    assert (config.port, config.metrics_port) == (GRPC_PORT, METRICS_PORT)
    (deployment,) = only(objects, "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    for service in only(objects, "Service"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: no container port {port}"
            assert port["port"] == ports[port["targetPort"]]
        assert any(p["name"] == "grpc" for p in service["spec"]["ports"])


@pytest.mark.parametrize("name", WORKLOADS)
def test_termination_grace_outlasts_the_drain(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (deployment,) = only(rendered[name], "Deployment")
    container = server_container(rendered[name])
    config = server_config_from_env(tokenwire_env(container_env(container)), monkeypatch)
    # The preStop sleep keeps the pod serving while its endpoint removal spreads.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and len(pre_stop) == 2, pre_stop
    pre_stop_seconds = int(pre_stop[1])
    assert pre_stop_seconds > 0
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The kubelet's clock starts before preStop; the server's after it, at SIGTERM.
    assert grace > pre_stop_seconds + config.grace_period, (grace, pre_stop_seconds, config.grace_period)


@pytest.mark.parametrize("name", WORKLOADS)
def test_environment_is_a_valid_server_configuration(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = tokenwire_env(container_env(server_container(rendered[name])))
    unknown = {k for k in env if k.removeprefix("TOKENWIRE_").lower() not in config_fields()}
    assert not unknown, f"no such server setting: {sorted(unknown)}"
    config = server_config_from_env(env, monkeypatch)
    assert config.host == "0.0.0.0" or "TOKENWIRE_HOST" not in env
    assert config.log_format == "json"


def test_base_runs_on_a_gpu_and_cpu_overlay_on_cpu(
    rendered: dict[str, Objects], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = server_container(rendered["base"])
    assert gpu["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert server_config_from_env(tokenwire_env(container_env(gpu)), monkeypatch).device == "cuda"

    cpu = server_container(rendered["cpu"])
    assert "nvidia.com/gpu" not in str(rendered["cpu"]), "the CPU overlay still mentions GPUs"
    config = server_config_from_env(tokenwire_env(container_env(cpu)), monkeypatch)
    assert (config.device, config.model) == ("cpu", "default")
    assert container_env(cpu)["OMP_NUM_THREADS"] == str(cpu["resources"]["limits"]["cpu"])
    assert _memory_gib(cpu["resources"]["limits"]["memory"]) < _memory_gib(gpu["resources"]["limits"]["memory"])


def _memory_gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def _startup_budget_s(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return int(probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"])


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_container_is_locked_down(rendered: dict[str, Objects], name: str) -> None:
    (deployment,) = only(rendered[name], "Deployment")
    spec = pod_spec(deployment)
    assert spec is not None
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for container in pod_containers(deployment, init=True):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        assert context.get("seccompProfile", pod["seccompProfile"])["type"] == "RuntimeDefault"
        assert "resources" in container and "limits" in container["resources"], container["name"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_writable_paths_are_emptydir_volumes(rendered: dict[str, Objects], name: str) -> None:
    (deployment,) = only(rendered[name], "Deployment")
    spec = pod_spec(deployment)
    assert spec is not None
    volumes = {v["name"]: v for v in spec["volumes"]}
    container = server_container(rendered[name])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    cache_dir = container_env(container)["TOKENWIRE_CACHE_DIR"]
    for path in (cache_dir, "/tmp"):
        assert path in mounts, f"{path} is not writable"
        assert "emptyDir" in volumes[mounts[path]]
    # The init container seeds that same volume from the image's own cache directory.
    (seed,) = spec["initContainers"]
    assert seed["image"] == container["image"]
    assert [m["name"] for m in seed["volumeMounts"]] == [mounts[cache_dir]]
    seed_path = seed["volumeMounts"][0]["mountPath"]
    assert f"cp -R {cache_dir}/. {seed_path}/" in " ".join(seed["command"])


@pytest.mark.parametrize("name", WORKLOADS)
def test_selectors_reach_the_pods(rendered: dict[str, Objects], name: str) -> None:
    objects = rendered[name]
    (deployment,) = only(objects, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    assert selects(deployment["spec"]["selector"]["matchLabels"])
    services = {s["metadata"]["name"]: s["spec"] for s in only(objects, "Service")}
    assert all(selects(spec["selector"]) for spec in services.values())
    assert sorted(spec.get("clusterIP", "") == "None" for spec in services.values()) == [False, True], (
        "one headless Service (client-side round_robin) and one ClusterIP Service"
    )
    (pdb,) = only(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"])


def scalers(objects: Objects) -> list[dict[str, Any]]:
    return only(objects, "HorizontalPodAutoscaler") + only(objects, "ScaledObject")


def replica_bounds(scaler: dict[str, Any]) -> tuple[int, int]:
    spec = scaler["spec"]
    if scaler["kind"] == "ScaledObject":
        return spec["minReplicaCount"], spec["maxReplicaCount"]
    return spec["minReplicas"], spec["maxReplicas"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_one_autoscaler_targets_the_deployment(rendered: dict[str, Objects], name: str) -> None:
    objects = rendered[name]
    (deployment,) = only(objects, "Deployment")
    (scaler,) = scalers(objects)  # two would fight over the replica count
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        deployment["metadata"]["name"],
    )
    low, high = replica_bounds(scaler)
    assert 0 <= low < high


@pytest.mark.parametrize("name", WORKLOADS)
def test_rollout_and_disruption_keep_capacity(rendered: dict[str, Objects], name: str) -> None:
    objects = rendered[name]
    (deployment,) = only(objects, "Deployment")
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    (pdb,) = only(objects, "PodDisruptionBudget")
    (scaler,) = scalers(objects)
    low, _ = replica_bounds(scaler)
    # A node drain must leave a replica serving (a scaler that may go to zero has nothing to keep).
    assert low == 0 or pdb["spec"]["maxUnavailable"] < low
    if scaler["kind"] == "ScaledObject":
        assert "replicas" not in deployment["spec"], "KEDA owns the replica count: `kubectl apply` must not reset it"
    else:
        assert deployment["spec"]["replicas"] >= low


@pytest.mark.parametrize("name", HPA_WORKLOADS)
def test_hpa_scales_on_gauges_the_server_exposes(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (hpa,) = only(rendered[name], "HorizontalPodAutoscaler")
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert set(metrics) == {"tokenwire_queue_depth", "tokenwire_active_streams"}
    assert set(metrics) <= server_gauges(), f"not gauges of the server: {set(metrics)}"
    config = server_config_from_env(tokenwire_env(container_env(server_container(rendered[name]))), monkeypatch)
    target = float(metrics["tokenwire_active_streams"]["averageValue"])
    assert 0 < target < config.max_active, "the active-streams target must be reachable"
    assert 0 < float(metrics["tokenwire_queue_depth"]["averageValue"]) < config.max_queue


# The image each workload runs: the vLLM overlay needs the `--build-arg ENGINE=vllm` build.
IMAGE_TAGS = {"vllm": "0.1.0-vllm"}


@pytest.mark.parametrize("name", WORKLOADS)
def test_images_are_set_by_the_kustomization(rendered: dict[str, Objects], name: str) -> None:
    (deployment,) = only(rendered[name], "Deployment")
    images = {c["image"] for c in pod_containers(deployment, init=True)}
    tag = IMAGE_TAGS.get(name, "0.1.0")
    assert len(images) == 1 and images.pop().endswith(f"/tokenwire:{tag}")


# --- KEDA ------------------------------------------------------------------------


def test_keda_overlay_swaps_the_hpa_for_a_scaledobject(rendered: dict[str, Objects]) -> None:
    """Everything else is base as it is, except the replica count, which KEDA owns."""
    base = [obj for obj in rendered["base"] if obj["kind"] != "HorizontalPodAutoscaler"]
    keda = [obj for obj in rendered["keda"] if obj["kind"] != "ScaledObject"]
    (deployment,) = only(base, "Deployment")
    unscaled = {**deployment, "spec": {k: v for k, v in deployment["spec"].items() if k != "replicas"}}
    expected = [unscaled if obj is deployment else obj for obj in base]
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    assert sorted(keda, key=key) == sorted(expected, key=key)
    assert only(rendered["base"], "HorizontalPodAutoscaler"), "base keeps its HPA for clusters without KEDA"
    assert not only(rendered["keda"], "HorizontalPodAutoscaler")


def test_keda_scales_on_the_load_per_replica(rendered: dict[str, Objects], monkeypatch: pytest.MonkeyPatch) -> None:
    (scaled,) = only(rendered["keda"], "ScaledObject")
    spec = scaled["spec"]
    (trigger,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
    assert trigger["metricType"] == "AverageValue", "the threshold is per replica"
    metadata = trigger["metadata"]
    assert set(metadata) >= {"serverAddress", "query", "threshold"}
    assert re.match(r"^https?://[^/\s]+", metadata["serverAddress"])
    # Requests decoding plus requests waiting, over all replicas.
    assert promql_metric_names(metadata["query"]) == {"tokenwire_active_streams", "tokenwire_queue_depth"}
    assert promql_metric_names(metadata["query"]) <= server_gauges()
    assert metadata["query"].count("sum(") == 2
    config = server_config_from_env(tokenwire_env(container_env(server_container(rendered["keda"]))), monkeypatch)
    assert 0 < float(metadata["threshold"]) < config.max_active, "the per-replica target must be reachable"
    assert float(metadata.get("activationThreshold", "0")) >= 0
    # KEDA's HPA scales like the base HPA: at once up, slowly down (a replica costs a model load).
    (hpa,) = only(rendered["base"], "HorizontalPodAutoscaler")
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    assert spec["maxReplicaCount"] == hpa["spec"]["maxReplicas"]
    low, high = replica_bounds(scaled)
    assert low <= spec["fallback"]["replicas"] <= high
    assert spec["fallback"]["failureThreshold"] >= 1


# Triggers on what the pods themselves produce: with no pod there is nothing to read.
POD_RESOURCE_TRIGGERS = {"cpu", "memory"}
OPERATIONS_DOC = REPO / "docs" / "operations.md"


def wakers(scaled: dict[str, Any]) -> list[dict[str, Any]]:
    """The triggers of a ScaledObject that see demand while no pod runs: not the pods' CPU or
    memory, and no tokenwire_* series (only the pods export those); each one able to turn
    active (a cron window that asks for at least one replica; a query with an address)."""
    found = []
    for trigger in scaled["spec"]["triggers"]:
        metadata = trigger.get("metadata", {})
        if trigger["type"] in POD_RESOURCE_TRIGGERS or promql_metric_names(str(metadata)):
            continue
        if trigger["type"] == "cron":
            assert {"timezone", "start", "end", "desiredReplicas"} <= set(metadata), trigger
            if int(metadata["desiredReplicas"]) < 1:
                continue
        elif trigger["type"] == "prometheus":
            assert {"serverAddress", "query", "threshold"} <= set(metadata), trigger
        found.append(trigger)
    return found


def scale_to_zero_patches() -> list[dict[str, Any]]:
    """The patches docs/operations.md ("Scale to zero and back") puts on the KEDA overlay."""
    text = OPERATIONS_DOC.read_text()
    start = text.index("### Scale to zero and back")
    section = text[start : text.index("\n## ", start)]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    return yaml.safe_load(block)["patches"]


def kustomize_on_keda(folder: Path, patches: list[dict[str, Any]]) -> Objects:
    """`kubectl kustomize` of an overlay that puts ``patches`` on deploy/overlays/keda."""
    folder.mkdir(parents=True, exist_ok=True)
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZATIONS["keda"], folder)],
        "patches": patches,
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    return kustomize(folder)


def test_keda_can_wake_from_zero(rendered: dict[str, Objects], tmp_path: Path) -> None:
    """At zero replicas no pod exports tokenwire_* gauges: scaling to zero needs a trigger that
    sees demand without the pods (an ingress metric, the callers' metrics, a cron window).
    Checked on the rendered objects: the overlay as shipped, and the overlay with the patch
    docs/operations.md gives for scale to zero (minReplicaCount 0 plus a waking trigger)."""
    (shipped,) = only(rendered["keda"], "ScaledObject")
    if shipped["spec"]["minReplicaCount"] == 0:
        assert wakers(shipped), "minReplicaCount 0 with no trigger that sees demand while no pod runs"
    # The control: the shipped trigger alone, at 0, would never scale up again (what the
    # overlay's comment and the guide say, and why it keeps minReplicaCount 2).
    alone = copy.deepcopy(shipped)
    alone["spec"]["minReplicaCount"] = 0
    assert alone["spec"]["triggers"] and not wakers(alone)

    (scaled,) = only(kustomize_on_keda(tmp_path / "scale-to-zero", scale_to_zero_patches()), "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0, "the guide's patch is the one that scales to zero"
    assert wakers(scaled), "the guide's scale-to-zero patch leaves nothing that wakes the Deployment from 0"
    # It adds to the load trigger, it does not replace it: above zero KEDA still scales on the load.
    assert shipped["spec"]["triggers"][0] in scaled["spec"]["triggers"]


# --- vLLM ------------------------------------------------------------------------


def test_vllm_overlay_runs_the_vllm_engine_on_tensor_parallel_gpus(
    rendered: dict[str, Objects], monkeypatch: pytest.MonkeyPatch
) -> None:
    container = server_container(rendered["vllm"])
    env = container_env(container)
    assert env["TOKENWIRE_ENGINE"] == "vllm"
    config = server_config_from_env(tokenwire_env(env), monkeypatch)
    assert (config.engine, config.device) == ("vllm", "cuda")
    assert "TOKENWIRE_TENSOR_PARALLEL_SIZE" in env
    # One pod, one node: tensor parallelism only (pipeline stages across nodes need Ray).
    assert config.pipeline_parallel_size == 1
    assert config.tensor_parallel_size > 1, "the example splits the model over several GPUs"
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == config.tensor_parallel_size
    assert resources["limits"]["nvidia.com/gpu"] == config.tensor_parallel_size


def test_vllm_overlay_gives_the_workers_shared_memory(rendered: dict[str, Objects]) -> None:
    (deployment,) = only(rendered["vllm"], "Deployment")
    spec = pod_spec(deployment)
    assert spec is not None
    container = server_container(rendered["vllm"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts and not mounts["/dev/shm"].get("readOnly", False)
    volumes = {v["name"]: v for v in spec["volumes"]}
    empty_dir = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert empty_dir["medium"] == "Memory", "/dev/shm must be RAM-backed (tmpfs)"
    shm_gib = _memory_gib(empty_dir["sizeLimit"])
    assert shm_gib >= 1, "a container's own /dev/shm is 64 MiB"
    # A Memory emptyDir counts against the container's memory limit: what is left for the
    # processes must still be at least what base gives one.
    limit_gib = _memory_gib(container["resources"]["limits"]["memory"])
    base_gib = _memory_gib(server_container(rendered["base"])["resources"]["limits"]["memory"])
    assert limit_gib - shm_gib >= base_gib


def test_vllm_startup_allows_compilation_and_cuda_graph_capture(rendered: dict[str, Objects]) -> None:
    vllm, base = server_container(rendered["vllm"]), server_container(rendered["base"])
    budget = _startup_budget_s(vllm)
    assert budget >= 15 * 60, f"startupProbe gives vLLM {budget} s to load, compile and capture"
    assert vllm["startupProbe"]["grpc"] == base["startupProbe"]["grpc"]
    assert vllm["livenessProbe"] == base["livenessProbe"]
    assert vllm["readinessProbe"] == base["readinessProbe"]


# The fields the vLLM overlay changes in base's Deployment; everything else, including every
# securityContext, must stay base's.
VLLM_CONTAINER_CHANGES = ("env", "image", "resources", "startupProbe", "volumeMounts")


def test_vllm_overlay_is_base_but_for_the_engine_gpus_memory_and_start(rendered: dict[str, Objects]) -> None:
    base, vllm = rendered["base"], rendered["vllm"]
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    others = sorted((o for o in vllm if o["kind"] != "Deployment"), key=key)
    assert others == sorted((o for o in base if o["kind"] != "Deployment"), key=key)
    (base_deployment,) = only(base, "Deployment")
    (vllm_deployment,) = only(vllm, "Deployment")
    base_spec, vllm_spec = pod_spec(base_deployment), pod_spec(vllm_deployment)
    assert base_spec is not None and vllm_spec is not None
    # Env and mounts: base's entries are all kept, with base's values but the engine's own.
    vllm_env = container_env(server_container(vllm))
    for name, value in container_env(server_container(base)).items():
        assert vllm_env[name] == value, name
    vllm_mounts = server_container(vllm)["volumeMounts"]
    assert all(m in vllm_mounts for m in server_container(base)["volumeMounts"])
    base_volumes = {v["name"] for v in base_spec["volumes"]}
    assert base_volumes < {v["name"] for v in vllm_spec["volumes"]}
    # Everything else: put base's values back into the changed fields, and compare.
    restored = copy.deepcopy(vllm_deployment)
    restored_spec = pod_spec(restored)
    assert restored_spec is not None
    restored_spec["volumes"] = base_spec["volumes"]
    for index, container in enumerate(restored_spec["containers"]):
        for field in VLLM_CONTAINER_CHANGES:
            container[field] = base_spec["containers"][index][field]
    for index, container in enumerate(restored_spec["initContainers"]):
        container["image"] = base_spec["initContainers"][index]["image"]
    assert restored == base_deployment
