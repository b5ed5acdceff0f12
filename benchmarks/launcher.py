"""The servers the tests, the benchmarks and the soak run: tokenwire's (``ServerProcess``: on 127.0.0.1 port 0,
ready once its readiness check says so), the peers' OpenAI-compatible ones (``OpenAIServer``), and the figures
measured of their processes. ``serve``/``serve_openai`` hand out the fakes of benchmarks/fake.py under ``--dry-run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

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

    # How the test suite starts its servers faster than exec (tests/zygote.py): called with
    # the command and its environment, it returns a Popen-like process, or None where only
    # exec will do. None here: every server is exec'd (the benchmarks, start-up under test).
    spawner: Callable[[list[str], dict[str, str]], Any] | None = None

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, ready_timeout: float = 180.0,
                 python: str | None = None, wait: bool = True,
                 spawner: Callable[[list[str], dict[str, str]], Any] | None | bool = True,
                 stop_timeout: float = 60.0) -> None:  # fmt: skip
        """``python``: the interpreter (another venv's, e.g. .venv-vllm's); this one by default.
        It leads its own process group, so that stopping it stops what it started (vLLM's
        engine core and workers). ``wait``: return once it is ready (else at once:
        ``wait_listening``, then poll it). ``spawner``: ``None`` to insist on exec, else the
        class's. ``stop_timeout``: what leaving ``with`` waits for it."""
        python = python or sys.executable
        cmd = [python, "-m", "tokenwire_server", "--host", "127.0.0.1", "--port", "0", "--log-format", "json", *args]
        full_env = {"PYTHONUNBUFFERED": "1", **os.environ, **(env or {})}
        self.args = list(args)
        self.stop_timeout = stop_timeout
        spawn = type(self).spawner if spawner is True else spawner
        forked = spawn(cmd, full_env) if callable(spawn) else None
        self.proc = forked or subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
        )
        self.lines: list[str] = []
        self.records: list[dict] = []
        self.port = 0
        self.metrics_port = 0
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_listening(ready_timeout)
            self.wait_ready(ready_timeout)

    def wait_listening(self, timeout: float) -> None:
        """Wait for the "listening" line (or the end of the output); ``target`` is the bound
        address from then on."""
        if not self._listening.wait(timeout):
            self.kill()
            raise RuntimeError("server did not start listening:\n" + self.output())
        self.target = f"127.0.0.1:{self.port}"

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

    def health(
        self, service: str = READINESS, timeout: float = 2.0, credentials: grpc.ChannelCredentials | None = None
    ) -> int:
        return health_check(self.target, service, timeout, credentials)

    def wait_ready(self, timeout: float, credentials: grpc.ChannelCredentials | None = None, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n" + self.output())
            try:
                if self.health(credentials=credentials) == SERVING:
                    return
            except grpc.RpcError:  # the port is open before the health service answers
                pass
            time.sleep(poll)
        raise RuntimeError("server did not become ready:\n" + self.output())

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def find(self, msg: str) -> list[dict]:
        return [r for r in self.records if r.get("msg") == msg]

    def wait_for(self, msg: str, where: Callable[[dict], bool] = lambda r: True, timeout: float = 10.0) -> list[dict]:
        """``find(msg)``'s records that ``where`` accepts, waiting up to ``timeout`` s for one: a line the server
        wrote before it answered a call can reach this process's reader a moment after the answer."""
        deadline = time.monotonic() + timeout
        while not (found := [r for r in self.find(msg) if where(r)]) and time.monotonic() < deadline:
            if self.proc.poll() is not None:  # it has ended: what it wrote is read once the reader is done
                self._reader.join(max(0.0, deadline - time.monotonic()))
                return [r for r in self.find(msg) if where(r)]
            time.sleep(0.02)
        return found

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
            self.terminate(self.stop_timeout)
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


REPO = Path(__file__).resolve().parent.parent


def venv_python(name: str) -> str:
    """The interpreter of a peer's venv: ``vllm`` (.venv-vllm, ``$VLLM_PYTHON``)."""
    return os.environ.get(f"{name.upper()}_PYTHON", str(REPO / f".venv-{name}" / "bin" / "python"))


@contextlib.contextmanager
def serve(dry_run: bool, flags: Sequence[str], engine: str = "", **kwargs: Any) -> Iterator[Any]:
    """A tokenwire server with ``flags`` (``--engine engine`` first, where given; the vllm engine
    runs from its venv), or for a dry run the in-process fake that stands in for it."""
    flags = [*(["--engine", engine] if engine else []), *flags]
    if engine == "vllm":
        kwargs.setdefault("python", venv_python("vllm"))
    if dry_run:
        from benchmarks.fake import FakeServer

        server: Any = FakeServer(flags)
    else:
        server = ServerProcess(flags, **{"ready_timeout": 900.0, **kwargs})
    with server:
        yield server


class OpenAIServer:
    """An OpenAI-compatible server as a child process group on 127.0.0.1, serving ``model`` as
    "default": vLLM's (``kind`` "vllm", ``program`` its venv's interpreter) or llama.cpp's
    (``kind`` "llamacpp", ``program`` its llama-server binary)."""

    def __init__(self, program: str, model: Path, args: Sequence[str], env: dict[str, str], log: Path,
                 ready_timeout: float, kind: str) -> None:  # fmt: skip
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            self.port = int(free.getsockname()[1])
        vllm = kind == "vllm"
        api_server = [program, "-m", "vllm.entrypoints.openai.api_server", "--uvicorn-log-level", "warning"]
        run = api_server if vllm else [program]
        where = ["--host", "127.0.0.1", "--port", str(self.port)]
        alias = "--served-model-name" if vllm else "--alias"
        self.command = [*run, "--model", str(model), alias, "default", *where, *args]
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind}'s OpenAI server exited with {self.proc.returncode}; see {log}")
            with contextlib.suppress(OSError):  # 200 once the model is loaded (llama-server: 503 while it loads)
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200:
                    return
            time.sleep(1)
        self.close()
        raise RuntimeError(f"{kind}'s OpenAI server was not ready in {ready_timeout:.0f} s; see {log}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def serve_openai(dry_run: bool, *server_args: Any, **kwargs: Any) -> Any:
    """An ``OpenAIServer``, or for a dry run the fake SSE backend that stands in for it."""
    if dry_run:
        from benchmarks.fake import FakeOpenAI

        return FakeOpenAI()
    return OpenAIServer(*server_args, **kwargs)


def tree_usage(pid: int) -> tuple[float, float]:
    """(CPU seconds used, resident MB) of ``pid`` and all its descendants together, from /proc."""
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stats[int(entry.name)] = fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    cpu, pages, todo = 0, 0, [pid]
    while todo:
        process = todo.pop()
        todo.extend(children.get(process, []))
        if fields := stats.get(process):  # utime and stime in clock ticks; resident pages
            cpu, pages = cpu + int(fields[11]) + int(fields[12]), pages + int(fields[21])
    return cpu / os.sysconf("SC_CLK_TCK"), pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def tenant_flags(folder: Path, tokens: str, tenants: str | None = None) -> list[str]:
    """A server's flags for bearer ``tokens`` (the token file's lines: "token [tenant]") and ``tenants``
    (tenants.toml), the files written into ``folder``."""
    (folder / "tokens").write_text(tokens)
    if tenants is None:
        return ["--auth-token-file", str(folder / "tokens")]
    (folder / "tenants.toml").write_text(tenants)
    return ["--auth-token-file", str(folder / "tokens"), "--tenant-config", str(folder / "tenants.toml")]
