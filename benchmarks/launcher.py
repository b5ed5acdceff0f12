"""Launch a real tokenwire server as a child process, for tests, the benchmark and the soak.

It listens on 127.0.0.1 port 0; the bound port is read back from the server's own
"listening" log line, and it is ready once the readiness health check says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenwire_server.health import READINESS_SERVICE as READINESS
from tokenwire_server.health import SERVING


def health_check(
    target: str, service: str = READINESS, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None
) -> int:
    """One grpc.health.v1 Check of ``service`` at ``target``; the status enum value."""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


class ServerProcess:
    """A `python -m tokenwire_server` child process with JSON logs captured."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        ready_timeout: float = 180.0,
        python: str | None = None,
    ) -> None:
        """``python``: the interpreter to run it with (another venv's, e.g. .venv-vllm's);
        this one by default. The server leads its own process group, so that stopping it
        also stops the processes it started (vLLM's engine core and workers)."""
        python = python or sys.executable
        cmd = [python, "-m", "tokenwire_server", "--host", "127.0.0.1", "--port", "0", "--log-format", "json", *args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.args = list(args)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
        )
        self.lines: list[str] = []
        self.records: list[dict] = []
        self.port = 0
        self.metrics_port = 0
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._listening.wait(ready_timeout):
            self.kill()
            raise RuntimeError("server did not start listening:\n" + self.output())
        self.target = f"127.0.0.1:{self.port}"
        self.wait_ready(ready_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.records.append(record)
            if record.get("msg") == "listening":
                self.port = int(record["port"])
                self._listening.set()
            if record.get("msg") == "metrics":
                self.metrics_port = int(record["metrics_port"])
        self._listening.set()

    def output(self) -> str:
        return "\n".join(self.lines[-200:])

    def health(self, service: str = READINESS, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None) -> int:
        return health_check(self.target, service, timeout, credentials)

    def wait_ready(self, timeout: float, credentials: grpc.ChannelCredentials | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + self.output())
            try:
                if self.health(credentials=credentials) == SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready:\n" + self.output())

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def find(self, msg: str) -> list[dict]:
        return [r for r in self.records if r.get("msg") == msg]

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever it started and left behind

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate()
        finally:
            self.kill()


def process_status(pid: int) -> dict[str, int]:
    """Threads and resident memory (current and peak, in KiB) of a process, from /proc."""
    wanted = {"Threads": "threads", "VmRSS": "rss_kib", "VmHWM": "peak_rss_kib"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                out[wanted[key]] = int(value.split()[0])
    return out
