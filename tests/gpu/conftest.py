"""The GPU subset (`make test-gpu`): skipped where torch sees no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "production"))


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items, not only this folder's: mark ours alone.
    import torch

    skip = pytest.mark.skip(reason="no CUDA device: `make test-gpu` runs on a GPU host")
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture
def in_process_server(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """Factory of servers in this process (for fault injection into their model); drained after."""
    from typing import Any

    from production_support import InProcessServer
    from tokenwire_server.config import ServerConfig

    started: list[InProcessServer] = []

    def start(**overrides: Any) -> InProcessServer:
        fields: dict[str, Any] = dict(model=str(tiny_model_dir), host="127.0.0.1", port=0, grace_period=5.0)
        fields.update(overrides)
        server = InProcessServer(ServerConfig(**fields))
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()
