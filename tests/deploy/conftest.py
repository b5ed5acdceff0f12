"""Fixtures for the deployment tests; the helpers live in deploy_support.py."""

from __future__ import annotations

from typing import Any

import pytest
from deploy_support import KUSTOMIZATIONS, Stage, read_dockerfile, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every kustomization in deploy/, rendered: {"base": [...], "cpu": [...]}."""
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}


@pytest.fixture(scope="session")
def stages() -> list[Stage]:
    """The Dockerfile's build stages, in order."""
    return read_dockerfile()
