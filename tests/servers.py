"""Real servers for tests: see benchmarks/launcher.py (shared with the benchmark and the soak)."""

from benchmarks.launcher import READINESS, ServerProcess, health_check, process_status

__all__ = ["READINESS", "ServerProcess", "health_check", "process_status"]
