"""Real servers for tests: see tokenwire_server.launcher."""

from tokenwire_server.launcher import READINESS, ServerProcess, process_status

__all__ = ["READINESS", "ServerProcess", "process_status"]
