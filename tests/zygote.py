"""Test servers forked from a process that has already imported torch and transformers.

Most of a tiny-model server's start-up is Python importing torch and transformers (on a
loaded 2-core host about 10 of its 12 s). The suite starts
about a hundred servers, so it runs them as forks of one *zygote*: a child of the test
process that imports those libraries once, on a single thread, and then forks a server for
each ``ServerProcess``. The fork runs the same ``python -m tokenwire_server`` main with the
same arguments, environment, working directory and stdout as exec would, in a session of
its own; it starts in about a second.

What a fork cannot do is change what the libraries read as they load, so a server is
exec'd as before when:

- its environment differs from the zygote's in anything but the variables tokenwire reads
  at run time (``TOKENWIRE_*``, ``OTEL_*``, ``XDG_CACHE_HOME``, ``CXX``; pytest's own ``PYTEST_*``):
  ``ATEN_CPU_CAPABILITY``, ``GOMP_SPINCOUNT`` and the like are read by torch or OpenMP once;
- it asks for a ``--omp-spin-count`` other than the default the zygote loaded OpenMP with;
- it runs the vllm engine, which starts processes of its own, or under another interpreter
  (the vllm venv), or the test asks for exec
  (``ServerProcess(..., spawner=None)``: start-up itself is under test);
- ``TOKENWIRE_TEST_EXEC=1`` is set: the whole suite exec's, as before.

The zygote never runs a parallel region, creates a thread or touches gRPC before it forks,
so the fork inherits no pool or lock in use. It reports each child's exit status (as
``Popen.returncode`` would: negative for a signal) over a pipe of the child's own, which is
how ``Forked`` waits for a process that is not its own child.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

SERVER_MODULE = ["-m", "tokenwire_server"]
# What tokenwire reads from its environment at run time (a fork can take these).
RUNTIME_VARIABLES = ("TOKENWIRE_", "OTEL_", "XDG_CACHE_HOME", "CXX", "PYTHONUNBUFFERED", "PYTEST_")
DEFAULT_OMP_SPIN_COUNT = "10000"  # config.py's omp_spin_count: what the zygote loads OpenMP with
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.tokenization_utils_fast",
    "tokenwire_server.config",
    "tokenwire_server.model",
    "tokenwire_server.text",
    "tokenwire_server.engine.batched",
    "tokenwire_server.engine.local",
)


# What the server sets itself before torch and transformers load, where unset: ``__main__``
# (GOMP_SPINCOUNT, from --omp-spin-count) and ``model.quiet_transformers``.
SERVER_DEFAULTS = {"GOMP_SPINCOUNT": DEFAULT_OMP_SPIN_COUNT, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def zygote_environment() -> dict[str, str]:
    """The zygote's environment: the test process's, with what the server sets by default."""
    return {**SERVER_DEFAULTS, **os.environ}


def server_setting(args: Sequence[str], env: dict[str, str], flag: str, default: str) -> str:
    """A server flag's value as the server reads it: ``--flag V`` or ``--flag=V``, else its
    ``TOKENWIRE_*`` variable, else ``default``."""
    value = env.get("TOKENWIRE_" + flag.removeprefix("--").replace("-", "_").upper(), default)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


class Forked:
    """The ``subprocess.Popen`` surface ``ServerProcess`` and the tests use, for a fork of
    the zygote: signals go to its pid, its exit status comes over ``status``."""

    def __init__(self, args: Sequence[str], pid: int, stdout: int, status: int) -> None:
        self.args = list(args)
        self.pid = pid
        self.stdout = open(stdout, encoding="utf-8", errors="replace")  # text, as Popen(text=True)
        self.stderr = None
        self.returncode: int | None = None
        self._status = status

    def _collect(self, timeout: float | None) -> bool:
        if self.returncode is None:
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                return False
            data = os.read(self._status, 64)
            os.close(self._status)
            # No status at all: the zygote died with its children's statuses (they die with it).
            self.returncode = int(data) if data else -signal.SIGKILL
        return True

    def poll(self) -> int | None:
        self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._collect(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: starts the zygote on first use, asks it for forks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._env: dict[str, str] = {}
        self.started: collections.Counter[str] = collections.Counter()  # "forked", or why exec

    def _start(self) -> socket.socket:
        if self._sock is None:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            env = self._env = zygote_environment()
            self._proc = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            theirs.close()
            self._sock = mine
            atexit.register(self.close)
        return self._sock

    def why_not(self, cmd: Sequence[str], env: dict[str, str]) -> str | None:
        """Why ``cmd`` with ``env`` must be exec'd; None: a fork behaves the same."""
        if cmd[0] != sys.executable:
            return "another interpreter"
        if list(cmd[1:3]) != SERVER_MODULE:
            return "not the server"
        if os.environ.get("TOKENWIRE_TEST_EXEC") == "1":
            return "TOKENWIRE_TEST_EXEC=1"
        args = list(cmd[3:])
        if server_setting(args, env, "--engine", "batched") == "vllm":
            return "the vllm engine (it starts processes of its own)"
        base = self._env or zygote_environment()
        # The server's environment once it has set its own defaults, before torch loads.
        spin = server_setting(args, env, "--omp-spin-count", DEFAULT_OMP_SPIN_COUNT)
        defaults = {**SERVER_DEFAULTS, "GOMP_SPINCOUNT": spin}
        if spin == "0":  # the server leaves OpenMP its own default
            del defaults["GOMP_SPINCOUNT"]
        effective = {**defaults, **env}
        changed = sorted(
            k
            for k in set(base) | set(effective)
            if base.get(k) != effective.get(k) and not k.startswith(RUNTIME_VARIABLES)
        )
        return f"environment: {', '.join(changed)}" if changed else None

    def spawn(self, cmd: Sequence[str], env: dict[str, str]) -> Forked | None:
        """A fork running ``cmd`` (``python -m tokenwire_server ...``), or None where only exec will do."""
        reason = self.why_not(cmd, env)
        self.started[reason or "forked"] += 1
        if reason is not None:
            return None
        out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        request = {"argv": ["tokenwire_server", *cmd[3:]], "env": env, "cwd": os.getcwd()}
        try:
            with self._lock:
                sock = self._start()
                if self._proc is not None and self._proc.poll() is not None:
                    raise RuntimeError(f"the test zygote exited with {self._proc.returncode}")
                socket.send_fds(sock, [json.dumps(request).encode()], [out_w, status_w])
                reply = json.loads(sock.recv(4096) or b"{}")
        finally:
            os.close(out_w)
            os.close(status_w)
        if "pid" not in reply:
            os.close(out_r)
            os.close(status_r)
            raise RuntimeError(f"the test zygote could not fork: {reply}")
        return Forked(cmd, int(reply["pid"]), out_r, status_r)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


ZYGOTE = Zygote()


def spawner(cmd: list[str], env: dict[str, str]) -> Any:
    """``ServerProcess.spawner`` for the suite."""
    return ZYGOTE.spawn(cmd, env)


# -- the zygote itself -------------------------------------------------------------------


def _child(request: dict[str, Any], out: int, closing: Sequence[int]) -> None:
    """In the fork: become ``python -m tokenwire_server`` and never return."""
    code: int = 1
    try:
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (PYTHONUNBUFFERED, as the tests set)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        sys.path[0] = os.getcwd()  # as `python -m` puts it (the zygote's is tests/)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        from tokenwire_server.__main__ import main

        try:
            code = main()
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        # What the interpreter does at exit: wait for non-daemon threads, run atexit.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(control: int) -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # another venv's transformers lays its modules out otherwise: the fork imports it
            pass
    sock = socket.socket(fileno=control)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
                if not message:  # the test process is gone
                    return
                out, status = fds
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(message), out, (status, sock.fileno(), wake_r, wake_w, *statuses.values()))
                os.close(out)
                statuses[pid] = status
                sock.send(json.dumps({"pid": pid}).encode())
            else:
                os.read(wake_r, 4096)
                while statuses:
                    pid, status_word = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    fd = statuses.pop(pid, None)
                    if fd is not None:
                        os.write(fd, str(os.waitstatus_to_exitcode(status_word)).encode())
                        os.close(fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
