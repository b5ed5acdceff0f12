"""Real servers for tests: see benchmarks/launcher.py (shared with the benchmark and the soak),
and the engine the contract tests run on."""

import os
import time
from typing import Any

from tokenwire_server.model import cpu_instruction_sets

from benchmarks.launcher import READINESS, ServerProcess, health_check, process_status

# `make test` runs the contract tests on the batched engine; `make test-vllm` sets
# TOKENWIRE_TEST_ENGINE=vllm and runs the same tests against vLLM (eager mode on a CPU:
# no compile warm-up).
TEST_ENGINE = os.environ.get("TOKENWIRE_TEST_ENGINE", "batched")
ENGINE_ARGS = (
    ["--engine", "vllm", "--enforce-eager", "--max-active", "8"] if TEST_ENGINE == "vllm" else ["--engine", TEST_ENGINE]
)


def cpu_auto_dtype(server: ServerProcess) -> str:
    """The dtype ``--dtype auto`` chose for ``server`` on a CPU, as its log says ("dtype auto"):
    float32 on a host without native bf16, whatever the log says; bfloat16 or float32 by the
    measurement on one with it (``model.cpu_precision``)."""
    chosen = [record["dtype"] for record in server.find("dtype auto")]
    assert len(chosen) == 1, server.output()
    if not {"amx_bf16", "avx512_bf16"} & set(cpu_instruction_sets()):
        assert chosen == ["float32"]
    assert chosen[0] in ("float32", "bfloat16")
    return str(chosen[0])


def seconds_per_token(client: Any, tokens: int = 200) -> float:
    """Seconds per decoded token of a ``tokens``-token stream through ``client`` (a
    ``tokenwire.Client``) on its server, now: the machine's own pace, for tests that size a
    stream or a deadline by it."""
    arrivals: list[float] = []
    last = None
    for chunk in client.generate("go", max_new_tokens=tokens, ignore_eos=True):
        arrivals.append(time.monotonic())
        last = chunk
    assert last is not None and last.usage is not None and last.usage.completion_tokens == tokens
    return (arrivals[-1] - arrivals[0]) / (tokens - 1)


__all__ = [
    "ENGINE_ARGS", "READINESS", "TEST_ENGINE", "ServerProcess", "cpu_auto_dtype", "health_check", "process_status",
    "seconds_per_token",
]  # fmt: skip
