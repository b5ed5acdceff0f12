"""deploy/: every kustomization renders to objects that are valid Kubernetes and that
agree with the server (health service names, ports, grace period, configuration)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from deploy_support import (
    GRPC_PORT,
    KUSTOMIZATIONS,
    LIVENESS_SERVICE,
    METRICS_PORT,
    READINESS_SERVICE,
    config_fields,
    container_env,
    only,
    pod_containers,
    pod_spec,
    render,
    server_config_from_env,
    server_container,
    server_gauges,
    strategic_merge,
    tokenwire_env,
)

# The oldest Kubernetes these manifests target (native gRPC probes are GA since 1.27)
# and the newest whose schemas kubernetes-validate ships: both offline.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
ALL = list(KUSTOMIZATIONS)
Objects = list[dict[str, Any]]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", ALL)
def test_every_object_is_valid_kubernetes(rendered: dict[str, Objects], name: str, version: str) -> None:
    kinds = set()
    for obj in rendered[name]:
        kubernetes_validate.validate(obj, version, strict=True)
        kinds.add(obj["kind"])
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("name", ALL)
def test_probes_use_the_servers_health_services(rendered: dict[str, Objects], name: str) -> None:
    container = server_container(rendered[name])
    probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"].get("service", "") == LIVENESS_SERVICE
    # Startup waits for readiness (model loaded and warmed), so liveness starts after the load.
    assert probes["startupProbe"]["service"] == READINESS_SERVICE
    assert probes["readinessProbe"]["service"] == READINESS_SERVICE
    assert {probe["port"] for probe in probes.values()} == {GRPC_PORT}


@pytest.mark.parametrize("name", ALL)
def test_startup_probe_allows_a_model_load(rendered: dict[str, Objects], name: str) -> None:
    probe = server_container(rendered[name])["startupProbe"]
    budget = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    assert budget >= 180, f"startupProbe gives the model {budget} s to load"


@pytest.mark.parametrize("name", ALL)
def test_ports_match_the_server(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
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


@pytest.mark.parametrize("name", ALL)
def test_termination_grace_outlasts_the_drain(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (deployment,) = only(rendered[name], "Deployment")
    container = server_container(rendered[name])
    config = server_config_from_env(tokenwire_env(container_env(container)), monkeypatch)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_seconds = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The kubelet's clock starts before preStop; the server's after it, at SIGTERM.
    assert grace > pre_stop_seconds + config.grace_period, (grace, pre_stop_seconds, config.grace_period)


@pytest.mark.parametrize("name", ALL)
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
    assert _memory_gib(cpu["resources"]["limits"]["memory"]) < _memory_gib(
        gpu["resources"]["limits"]["memory"]
    )


def _memory_gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("name", ALL)
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


@pytest.mark.parametrize("name", ALL)
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


@pytest.mark.parametrize("name", ALL)
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
    (hpa,) = only(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])


@pytest.mark.parametrize("name", ALL)
def test_rollout_and_disruption_keep_capacity(rendered: dict[str, Objects], name: str) -> None:
    objects = rendered[name]
    (deployment,) = only(objects, "Deployment")
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    (pdb,) = only(objects, "PodDisruptionBudget")
    (hpa,) = only(objects, "HorizontalPodAutoscaler")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    assert deployment["spec"]["replicas"] >= hpa["spec"]["minReplicas"]


@pytest.mark.parametrize("name", ALL)
def test_hpa_scales_on_gauges_the_server_exposes(
    rendered: dict[str, Objects], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (hpa,) = only(rendered[name], "HorizontalPodAutoscaler")
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert metrics and set(metrics) <= server_gauges(), f"not gauges of the server: {set(metrics)}"
    config = server_config_from_env(
        tokenwire_env(container_env(server_container(rendered[name]))), monkeypatch
    )
    if "tokenwire_active_streams" in metrics:
        target = float(metrics["tokenwire_active_streams"]["averageValue"])
        assert 0 < target < config.max_active, "the active-streams target must be reachable"


def test_images_are_set_by_the_kustomization(rendered: dict[str, Objects]) -> None:
    for objects in rendered.values():
        (deployment,) = only(objects, "Deployment")
        images = {c["image"] for c in pod_containers(deployment, init=True)}
        assert len(images) == 1 and images.pop().endswith("/tokenwire:0.1.0")


# --- the renderer itself ---------------------------------------------------------


def test_strategic_merge_follows_kubernetes() -> None:
    base = {
        "containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["--one"]}],
        "limits": {"cpu": "1", "nvidia.com/gpu": 1},
        "tolerations": [{"key": "k"}],
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["--two"]}],
        "limits": {"nvidia.com/gpu": None},
        "tolerations": None,
    }
    assert strategic_merge(base, patch) == {
        "containers": [
            {
                "name": "a",
                "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
                "args": ["--two"],
            }
        ],
        "limits": {"cpu": "1"},
    }
    with pytest.raises(NotImplementedError):
        strategic_merge({"ports": [{"containerPort": 1}]}, {"ports": [{"containerPort": 2}]})


def test_renderer_refuses_what_it_cannot_render(tmp_path: Any) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(NotImplementedError):
        render(tmp_path)
