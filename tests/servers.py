"""Real servers for tests: see benchmarks/launcher.py (shared with the benchmark and the soak),
and the engine the contract tests run on."""

import os

from benchmarks.launcher import READINESS, ServerProcess, health_check, process_status

# `make test` runs the contract tests on the batched engine; `make test-vllm` sets
# TOKENWIRE_TEST_ENGINE=vllm and runs the same tests against vLLM (eager mode on a CPU:
# no compile warm-up).
TEST_ENGINE = os.environ.get("TOKENWIRE_TEST_ENGINE", "batched")
ENGINE_ARGS = (
    ["--engine", "vllm", "--enforce-eager", "--max-active", "8"] if TEST_ENGINE == "vllm" else ["--engine", TEST_ENGINE]
)

__all__ = ["ENGINE_ARGS", "READINESS", "TEST_ENGINE", "ServerProcess", "health_check", "process_status"]
