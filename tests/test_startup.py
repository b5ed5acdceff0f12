"""Start-up: configuration from flags and environment, and clear errors instead of tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenwire_server.config import parse_config


def run_server(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

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


def test_prints_resolved_configuration_once(tiny_model_dir: Path):
    from servers import ServerProcess

    args = ["--model", str(tiny_model_dir), "--max-queue", "5", "--torch-threads", "1"]
    with ServerProcess(args, env={"TOKENWIRE_WORKERS": "3"}) as server:
        lines = [line for line in server.lines if line.startswith("tokenwire-server configuration:")]
        assert len(lines) == 1
        assert '"max_queue": 5' in lines[0] and '"workers": 3' in lines[0]
        # --torch-threads is applied, not only parsed: the server reports what torch uses
        assert [record["threads"] for record in server.find("torch")] == [1]


def test_readme_configuration_table_lists_every_flag():
    import dataclasses
    import re

    from tokenwire_server.config import ServerConfig, env_name

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(--[a-z-]+)` \| `(TOKENWIRE_[A-Z_]+)` \|", readme, flags=re.M))
    expected = {"--" + f.name.replace("_", "-"): env_name(f.name) for f in dataclasses.fields(ServerConfig)}
    assert rows == expected
