"""When a test server may be forked from the zygote, and when only exec will do (tests/zygote.py)."""

from __future__ import annotations

import os
import sys

import pytest
from zygote import Zygote


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenwire_server", *args]


@pytest.mark.parametrize(
    ("cmd", "extra", "why"),
    [
        (command("--model", "m"), {}, None),
        (command("--omp-spin-count=10000"), {}, None),
        (command(), {"TOKENWIRE_WORKERS": "3", "PYTEST_CURRENT_TEST": "t", "OTEL_SERVICE_NAME": "s"}, None),
        (command("--engine", "vllm"), {}, "the vllm engine (it starts processes of its own)"),
        (command(), {"TOKENWIRE_ENGINE": "vllm"}, "the vllm engine (it starts processes of its own)"),
        (command("--omp-spin-count", "20000"), {}, "environment: GOMP_SPINCOUNT"),
        (command(), {"TOKENWIRE_OMP_SPIN_COUNT": "0"}, "environment: GOMP_SPINCOUNT"),
        (command(), {"GOMP_SPINCOUNT": "20000"}, "environment: GOMP_SPINCOUNT"),
        (command(), {"ATEN_CPU_CAPABILITY": "default"}, "environment: ATEN_CPU_CAPABILITY"),
        (["/other/venv/bin/python", "-m", "tokenwire_server"], {}, "another interpreter"),
    ],
)
def test_a_server_is_forked_only_where_a_fork_behaves_as_exec(cmd, extra, why, monkeypatch):
    monkeypatch.delenv("TOKENWIRE_TEST_EXEC", raising=False)
    for name in ("GOMP_SPINCOUNT", "ATEN_CPU_CAPABILITY", "TOKENWIRE_ENGINE", "TOKENWIRE_OMP_SPIN_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert Zygote().why_not(cmd, {**os.environ, **extra}) == why
