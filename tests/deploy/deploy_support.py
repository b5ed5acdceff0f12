"""Helpers for the deployment tests: a small kustomize renderer, a Dockerfile
reader, and the facts about the server (ports, health service names, grace period)
that the image and the manifests must agree with.

There is no kustomize binary here, so `render()` implements the part of kustomize
that deploy/ uses: `resources` (files and directories), `patches` (strategic merge,
from a file) and `images`. It refuses every other kustomization field and every
patch it cannot apply the way kustomize would, so a manifest change that needs more
fails here instead of rendering wrongly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
# Every kustomization a user may `kubectl apply -k`.
KUSTOMIZATIONS = {"base": DEPLOY / "base", "cpu": DEPLOY / "overlays" / "cpu"}

try:  # A checkout where `make setup` installed the package (editable) imports it directly.
    import tokenwire_server.config  # noqa: F401
except ImportError:  # pragma: no cover - a bare checkout: use the source tree
    sys.path[:0] = [str(REPO / "service"), str(REPO / "client")]

from tokenwire_server import config as server_config  # noqa: E402

# --- the server's side -----------------------------------------------------------


def health_service_names() -> tuple[str, str]:
    """(liveness, readiness) service names, as the server registers them."""
    from tokenwire.v1 import generation_pb2

    full_name = generation_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
    try:
        from tokenwire_server import health
    except ModuleNotFoundError as exc:
        if exc.name != "tokenwire_server.health":
            raise
        return "", full_name  # the server's health module is not written yet
    assert health.READINESS_SERVICE == full_name, "readiness must be the service's full name"
    return health.LIVENESS_SERVICE, health.READINESS_SERVICE


def client_cli_help(*command: str) -> str | None:
    """`tokenwire COMMAND --help`, or None while the client CLI does not exist yet."""
    try:
        from tokenwire import cli
    except ModuleNotFoundError as exc:
        if exc.name != "tokenwire.cli":
            raise
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.build_parser().parse_args([*command, "--help"])
    return out.getvalue()


def client_cli_accepts(argv: list[str]) -> bool | None:
    """Whether `tokenwire ARGV` parses (None while the client CLI does not exist yet)."""
    try:
        from tokenwire import cli
    except ModuleNotFoundError as exc:
        if exc.name != "tokenwire.cli":
            raise
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cli.build_parser().parse_args(argv)
    except SystemExit:
        return False
    return True


def server_series() -> set[str]:
    """Every series name the server's /metrics can show (counters with _total, histograms' parts)."""
    from tokenwire_server.metrics import Metrics

    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum", "_created"]}
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names |= {family.name + suffix for suffix in suffixes.get(family.type, [])}
    return names


def server_gauges() -> set[str]:
    from tokenwire_server.metrics import Metrics

    return {family.name for family in Metrics().registry.collect() if family.type == "gauge"}


LIVENESS_SERVICE, READINESS_SERVICE = health_service_names()
SERVER_DEFAULTS = server_config.ServerConfig()
# Ports the image and manifests use (the brief: gRPC on the server's default, metrics on 9090).
GRPC_PORT = SERVER_DEFAULTS.port
METRICS_PORT = 9090


def server_config_from_env(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> server_config.ServerConfig:
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


# --- a small kustomize ----------------------------------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
# Lists that strategic merge merges by `name` (their patchMergeKey in the Kubernetes API).
MERGE_BY_NAME = {"containers", "initContainers", "env", "volumes"}
# Lists whose merge key is not `name`: this renderer does not patch them.
MERGE_BY_OTHER_KEY = {"ports", "volumeMounts", "volumeDevices", "imagePullSecrets", "hostAliases"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints, for the features deploy/ uses."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization fields this renderer lacks: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise NotImplementedError(f"{directory}: only `patches: - path: FILE` is supported, got {patch}")
        docs = [doc for doc in yaml.safe_load_all((directory / patch["path"]).read_text()) if doc]
        for doc in docs:
            matches = [i for i, obj in enumerate(objects) if _same_object(obj, doc)]
            if len(matches) != 1:
                raise AssertionError(f"{patch['path']}: patch matches {len(matches)} objects, not 1")
            objects[matches[0]] = strategic_merge(objects[matches[0]], doc)
    for image in kustomization.get("images", []):
        _set_image(objects, image)
    keys = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    assert len(keys) == len(set(keys)), f"{directory}: duplicate objects {keys}"
    return objects


def _same_object(obj: dict[str, Any], patch: dict[str, Any]) -> bool:
    return (obj["apiVersion"], obj["kind"], obj["metadata"]["name"]) == (
        patch["apiVersion"],
        patch["kind"],
        patch["metadata"]["name"],
    )


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes strategic merge, restricted to what kustomize does for these manifests.

    Maps merge key by key; `null` deletes a key; lists in MERGE_BY_NAME merge item by
    item on `name`; other lists are replaced whole (as for lists without a merge key).
    """
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if key.startswith("$"):
                raise NotImplementedError(f"patch directive {key} is not supported")
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = _without_nulls(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list):
        if field in MERGE_BY_OTHER_KEY:
            raise NotImplementedError(f"patching `{field}` (merged by a key other than name)")
        if field in MERGE_BY_NAME:
            merged_list = copy.deepcopy(base)
            for item in patch:
                names = [i for i, old in enumerate(merged_list) if old["name"] == item["name"]]
                if names:
                    merged_list[names[0]] = strategic_merge(merged_list[names[0]], item)
                else:
                    merged_list.append(_without_nulls(item))
            return merged_list
    return _without_nulls(patch)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _set_image(objects: list[dict[str, Any]], image: dict[str, str]) -> None:
    if not set(image) <= {"name", "newName", "newTag", "digest"}:
        raise NotImplementedError(f"images entry {image}")
    for container in (c for obj in objects for c in pod_containers(obj, init=True)):
        name = re.split(r"[@]|:(?=[^/]*$)", container["image"])[0]
        if name != image["name"]:
            continue
        new = image.get("newName", name)
        if "digest" in image:
            new += "@" + image["digest"]
        elif "newTag" in image:
            new += ":" + str(image["newTag"])
        container["image"] = new


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


def read_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    """The Dockerfile's stages, with continuation lines joined and comments dropped."""
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
    stages: list[Stage] = []
    for number, text in logical:
        keyword, _, args = text.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), number)
        if instruction.keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else str(len(stages))
            stages.append(Stage(words[0], name, []))
        elif stages:
            stages[-1].instructions.append(instruction)
    return stages
