"""Start-up: configuration from flags and environment, clear errors instead of tracebacks,
and readiness NOT_SERVING while the model loads and warms up (liveness SERVING meanwhile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from tokenwire_server.config import parse_config


def run_server(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "tokenwire_server", "--port", "0", "--host", "127.0.0.1", "--log-format", "text", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("TOKENWIRE_MAX_ACTIVE", "7")
    monkeypatch.setenv("TOKENWIRE_LOG_PROMPTS", "true")
    config = parse_config([])
    assert config.max_active == 7 and config.log_prompts
    assert parse_config(["--max-active", "3"]).max_active == 3


@pytest.mark.parametrize("value", ["on", "off", "auto"])
def test_overlap_comes_from_the_flag_or_the_environment(monkeypatch, value):
    """--overlap and TOKENWIRE_OVERLAP reach the configuration (the in-process servers of
    tests/production then check that it reaches the engine); the default is auto."""
    assert parse_config([]).overlap == "auto"
    assert parse_config(["--overlap", value]).overlap == value
    monkeypatch.setenv("TOKENWIRE_OVERLAP", value)
    assert parse_config([]).overlap == value
    assert parse_config(["--overlap", "off" if value != "off" else "on"]).overlap != value
    with pytest.raises(SystemExit):
        parse_config(["--overlap", "sometimes"])


def test_missing_model_folder_is_a_clear_error(tmp_path: Path):
    result = run_server("--model", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not 'default', a folder or a .gguf file" in result.stderr
    assert "Traceback" not in result.stderr


def test_tokenizer_model_mismatch_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path):
    import shutil

    from transformers import AutoConfig

    target = tmp_path / "mismatch"
    shutil.copytree(tiny_model_dir, target)
    config = AutoConfig.from_pretrained(target)
    config.vocab_size = 1000  # the weights no longer match the tokenizer
    config.save_pretrained(target)
    result = run_server("--model", str(target))
    assert result.returncode == 2
    assert "cannot load the model" in result.stderr or "do not match" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flag_values_are_usage_errors():
    result = run_server("--default-max-new-tokens", "5000", "--max-new-tokens-limit", "100")
    assert result.returncode == 2
    assert "--default-max-new-tokens must not exceed" in result.stderr
    result = run_server("--torch-threads", "-1")
    assert result.returncode == 2
    assert "--torch-threads must not be negative" in result.stderr


def test_prints_resolved_configuration_once(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    from servers import ServerProcess

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("TOKENWIRE_TORCH_THREADS", raising=False)  # the parallel suite's (conftest.py)
    args = ["--model", str(tiny_model_dir), "--max-queue", "5", "--torch-threads", "1"]
    with ServerProcess(args, env={"TOKENWIRE_WORKERS": "3"}) as server:
        lines = [line for line in server.lines if line.startswith("tokenwire-server configuration:")]
        assert len(lines) == 1
        assert '"max_queue": 5' in lines[0] and '"workers": 3' in lines[0]
        # --torch-threads is applied, not only parsed: the server reports what torch uses
        assert [record["threads"] for record in server.find("torch")] == [1]
        # and OpenMP's idle threads spin briefly (--omp-spin-count's default) before they sleep
        assert [record["omp_spin_count"] for record in server.find("torch")] == ["10000"]


def test_omp_spin_count_reaches_openmp_before_torch_loads(tiny_model_dir: Path):
    """GOMP_SPINCOUNT only counts if it is set before torch loads libgomp: nothing main() runs
    before it sets the variable may import torch, and an operator's own GOMP_SPINCOUNT wins."""
    from servers import ServerProcess

    probe = (
        "import sys\n"
        "from tokenwire_server import __main__, config, logs\n"
        "config.parse_config([]); logs.configure_logging('INFO', 'text')\n"
        "assert 'torch' not in sys.modules, 'torch loaded before GOMP_SPINCOUNT is set'\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
    args = ["--model", str(tiny_model_dir), "--omp-spin-count", "5"]
    with ServerProcess(args, env={"GOMP_SPINCOUNT": "20000"}) as server:
        assert [record["omp_spin_count"] for record in server.find("torch")] == ["20000"]
    result = run_server("--omp-spin-count", "-1")
    assert result.returncode == 2 and "--omp-spin-count must not be negative" in result.stderr


def test_readme_configuration_table_lists_every_flag():
    import dataclasses
    import re

    from tokenwire_server.config import ServerConfig, env_name

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)` \| `(TOKENWIRE_[A-Z_]+)` \|", readme, flags=re.M))
    expected = {"--" + f.name.replace("_", "-"): env_name(f.name) for f in dataclasses.fields(ServerConfig)}
    assert rows == expected


# The real server (`python -m tokenwire_server`'s main) with its model load and its warm-up
# held at gates the test opens: each phase lasts until the test has looked at it, by
# construction. Each gate writes a file when it is reached; "warmed" once the real warm-up
# has returned. Nothing in the server is changed: the gates wrap the two functions it calls.
GATED_SERVER = """
import asyncio, os, sys, time
from pathlib import Path

gates = Path(os.environ["TOKENWIRE_TEST_GATES"])
import tokenwire_server.model as model
import tokenwire_server.server as server

load_model, warm_up = model.load_model, server.warm_up

def gated_load_model(*args, **kwargs):
    (gates / "loading").touch()
    while not (gates / "load").exists():
        time.sleep(0.01)
    return load_model(*args, **kwargs)

async def gated_warm_up(*args, **kwargs):
    (gates / "warming").touch()
    while not (gates / "warm").exists():
        await asyncio.sleep(0.01)  # the event loop (health checks) runs on meanwhile
    await warm_up(*args, **kwargs)
    (gates / "warmed").touch()

model.load_model, server.warm_up = gated_load_model, gated_warm_up
from tokenwire_server.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def start_gated(
    model_dir: Path, gates: Path, awaited: str
) -> tuple[subprocess.Popen[str], list[str], list[int], threading.Event]:
    """GATED_SERVER on ``model_dir`` (its load and warm-up held at files in ``gates``): the
    process, its output lines as they come, its port once it listens, and an event set once
    it logs ``awaited`` (or its output ends)."""
    gates.mkdir()
    cmd = [sys.executable, "-c", GATED_SERVER, "--model", str(model_dir), "--host", "127.0.0.1", "--port", "0",
           "--log-format", "json"]  # fmt: skip
    env = {**os.environ, "TOKENWIRE_TEST_GATES": str(gates), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    port: list[int] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("msg") == "listening":
                port.append(int(record["port"]))
            if record.get("msg") == awaited:
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, lines, port, seen


def test_readiness_is_not_serving_while_the_model_loads_and_warms_up(tiny_model_dir: Path, tmp_path: Path) -> None:
    """README: readiness is NOT_SERVING until the model is loaded and warmed up; the port opens
    first (server.py), with liveness SERVING, so a startupProbe sees the process alive."""
    from servers import READINESS, health_check
    from tokenwire_server.health import LIVENESS_SERVICE, NOT_SERVING, SERVING

    gates = tmp_path / "gates"
    proc, lines, port, listening = start_gated(tiny_model_dir, gates, "listening")
    seen: list[tuple[str, int]] = []  # (phase, readiness), in the order observed

    def check(phase: str) -> int:
        status = health_check(target, READINESS, timeout=5)
        seen.append((phase, status))
        if status == SERVING:  # readiness may say SERVING only once the real warm-up returned
            assert (gates / "warmed").exists(), f"readiness SERVING during {phase}, after {len(seen) - 1} checks"
        return status

    def reached(gate: str, phase: str) -> None:
        """Check readiness over and over until the server reaches ``gate``."""
        deadline = time.monotonic() + 60
        while not (gates / gate).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            check(phase)

    try:
        assert listening.wait(60) and port, "".join(lines[-50:])
        target = f"127.0.0.1:{port[0]}"
        # From the first check after the port opened: NOT_SERVING, while the process is live.
        assert check("start-up") == NOT_SERVING
        assert health_check(target, LIVENESS_SERVICE, timeout=5) == SERVING
        reached("loading", "start-up")
        for _ in range(10):
            assert check("loading") == NOT_SERVING
        assert health_check(target, LIVENESS_SERVICE, timeout=5) == SERVING
        (gates / "load").touch()
        reached("warming", "loading")  # the model is loaded, the warm-up not yet run
        for _ in range(10):
            assert check("warming") == NOT_SERVING
        assert health_check(target, LIVENESS_SERVICE, timeout=5) == SERVING
        (gates / "warm").touch()
        deadline = time.monotonic() + 60
        while check("after warm-up") != SERVING:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.01)
        phases = [phase for phase, status in seen if status == NOT_SERVING]
        assert {"start-up", "loading", "warming"} <= set(phases)
    except grpc.RpcError as exc:
        pytest.fail(f"health check failed: {exc}\n" + "".join(lines[-50:]))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("phase", ["loading", "warming"])
def test_a_signal_during_start_up_stops_the_server_without_it_ever_being_ready(
    tiny_model_dir: Path, tmp_path: Path, phase: str
) -> None:
    """SIGTERM while the model loads (or warms up): the drain runs at once and says "stopped";
    when the load (warm-up) then returns, the server does not go on to serve: no "ready"
    line, readiness never SERVING, the engine closed, and the process exits 0."""
    import signal

    from servers import READINESS, health_check
    from tokenwire_server.health import SERVING

    proc, lines, port, stopped = start_gated(tiny_model_dir, tmp_path / "gates", "stopped")
    gates = tmp_path / "gates"
    try:
        if phase == "warming":
            (gates / "load").touch()
        deadline = time.monotonic() + 60
        while not (gates / phase).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.01)
        if phase == "warming":  # loaded, held before its warm-up
            assert port
        proc.send_signal(signal.SIGTERM)
        assert stopped.wait(30), "".join(lines[-50:])
        if port:
            try:
                assert health_check(f"127.0.0.1:{port[0]}", READINESS, timeout=2) != SERVING
            except grpc.RpcError:
                pass  # the port is already closed: not serving either
        (gates / "load").touch()
        (gates / "warm").touch()
        assert proc.wait(60) == 0, "".join(lines[-50:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    messages = [str(r.get("msg")) for r in records]
    assert "stopped" in messages and "ready" not in messages, messages
    assert any(m.startswith("start-up stopped") for m in messages), messages


def test_a_folder_marked_as_gguf_gets_an_unmarked_view_for_vllm_and_llamacpp(tmp_path: Path):
    """One helper (model.unmarked_view) serves vLLM's folder and llama.cpp's converter: links to
    the weights, a config.json without the GGUF marker; the marked folder itself is not touched,
    and an unmarked folder is used as it is."""
    import json

    from tokenwire_server.engine.vllm_backend import vllm_model_folder
    from tokenwire_server.model import gguf_marked

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    marked = {"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}
    (folder / "config.json").write_text(json.dumps(marked))
    view = vllm_model_folder(folder)
    assert view == tmp_path / "m-vllm" and (view / "model.safetensors").resolve() == folder / "model.safetensors"
    assert json.loads((view / "config.json").read_text()) == {"model_type": "llama"}
    assert gguf_marked(folder) and not gguf_marked(view)
    assert vllm_model_folder(view) == view  # unmarked: as it is
    assert vllm_model_folder(folder) == view  # made again over the links already there


def test_the_venvs_packages_and_the_tree_are_byte_compiled() -> None:
    """Every process the server or the suite starts imports torch, transformers and grpc; these
    hosts and the image set PYTHONDONTWRITEBYTECODE, so a module without its .pyc is compiled from
    source at every import, in every process (4.7-5.1 s for those three, against 2.0 s). `make
    setup` writes the packages' bytecode as it installs them (uv's --compile-bytecode) and `make
    test`/`make run` the tree's (compileall): each module here has its .pyc beside it."""
    import importlib
    import importlib.util

    missing = []
    for name in (
        "torch",
        "torch.nn.functional",
        "transformers",
        "grpc",
        "google.protobuf",
        "tokenwire_server.server",
        "tokenwire",
    ):
        source = importlib.import_module(name).__file__
        assert source is not None and source.endswith(".py"), name
        if not Path(importlib.util.cache_from_source(source)).is_file():
            missing.append(name)
    assert not missing, f"no bytecode for {missing}: `make setup` (packages) or `make bytecode` (the tree)"
