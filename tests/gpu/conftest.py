"""The GPU subset (`make test-gpu`): skipped where torch sees no CUDA device, but for the
CPU variants (parametrized ``device="cpu"``), which run everywhere."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cpu":
            continue  # a GPU test's CPU variant: runs everywhere
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture
def in_process_server(tiny_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """The production tests' factory of in-process servers (production_support.py), each with
    a KV budget of its own: sized from the card (a whole H200's ~125 GB), the first would
    leave no room for the servers after it in this process."""
    from production_support import in_process_servers

    with in_process_servers(tiny_model_dir) as start:
        yield lambda **overrides: start(**{"kv_cache_tokens": KV_CACHE_TOKENS, **overrides})


KV_CACHE_TOKENS = 1 << 16  # every GPU test server's (--kv-cache-tokens): a few MB on the tiny model
