"""Fixtures for the client's tests: fake servers on 127.0.0.1 and a way to run the CLI.

The client is imported from the checkout (``client/``) when it is not installed, so
these tests run in a bare venv with only the dependencies.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO / "client"
if str(CLIENT_DIR) not in sys.path:
    sys.path.insert(0, str(CLIENT_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakes import FakeServer  # noqa: E402


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    with FakeServer("a") as server:
        yield server


@pytest.fixture
def fakes3() -> Iterator[list[FakeServer]]:
    servers = [FakeServer(name).start() for name in ("a", "b", "c")]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for running ``python -m tokenwire.cli`` from the checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLIENT_DIR), env.get("PYTHONPATH")]))
    env.pop("TOKENWIRE_TARGET", None)
    env.pop("TOKENWIRE_TOKEN", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env
