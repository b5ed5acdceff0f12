"""Fixtures for the deployment tests; the helpers live in deploy_support.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from deploy_support import KUSTOMIZATIONS, Stage, kustomize, read_dockerfile


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization in deploy/, rendered by `kubectl kustomize`: {"base": [...], ...}."""
    with ThreadPoolExecutor(max_workers=len(KUSTOMIZATIONS)) as pool:
        futures = {name: pool.submit(kustomize, path) for name, path in KUSTOMIZATIONS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="session")
def stages() -> list[Stage]:
    """The Dockerfile's build stages, in order."""
    return read_dockerfile()
