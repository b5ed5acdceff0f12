"""Fixtures of the production-behaviour tests (helpers live in production_support.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from production_support import InProcessServer, Pki, in_process_servers, make_pki  # noqa: E402


@pytest.fixture
def in_process_server(tiny_model_dir: Path) -> Iterator[Callable[..., InProcessServer]]:
    """Factory: ``in_process_server(engine="simple", stall_timeout=1.0)``; each server is drained after the test."""
    with in_process_servers(tiny_model_dir) as start:
        yield start


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A test CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a stranger's."""
    return make_pki(tmp_path_factory.mktemp("pki"))
