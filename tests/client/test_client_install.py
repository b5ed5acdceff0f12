"""The base install is the client alone: a fresh venv with ``pip install <repo>`` (no extras)
imports tokenwire, calls a server and runs the CLI, and has no torch.

It builds the wheel from a copy of the checkout (so nothing is written into the
working tree) and installs it with pip's cache: tens of seconds, not minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import importlib.util, sys
    import tokenwire
    assert tokenwire.__file__.startswith(sys.prefix), tokenwire.__file__
    assert importlib.util.find_spec("torch") is None, "torch is installed"
    assert importlib.util.find_spec("transformers") is None, "transformers is installed"
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("import torch worked")
    with tokenwire.Client(sys.argv[1], timeout=10) as client:
        assert client.generate_text("installed and working").text == "installed and working"
        assert client.health() == "SERVING"
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "tokenwire_server"))
    assert not loaded, loaded
    print("ok")
    """
)


def _copy_project(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    for name in ("client", "service"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dest / name, ignore=ignore)


def test_base_install_has_the_client_and_no_torch(fake, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    _copy_project(project)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(project)],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    check = subprocess.run(
        [str(python), "-c", CHECK, fake.address], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip() == "ok"

    health = subprocess.run(
        [str(venv / "bin" / "tokenwire"), "health", "--target", fake.address],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert health.returncode == 0 and health.stdout.strip() == "SERVING", health.stderr
