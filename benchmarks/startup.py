"""How long a server takes from exec to readiness, and where that time goes (`make bench-startup`).

Each repeat starts a fresh server process on the model (the default model converted and
the compiled CPU ops built beforehand, as `make run` leaves them) and polls its readiness
service (grpc.health.v1) every 20 ms from the moment of exec until it answers SERVING: the
time a Kubernetes readiness probe could first pass. The server's own "ready" line says what
each phase took (``phases``: the interpreter and its imports, the libraries, the tokenizer,
the weights, the engine, the warm-up, the heap); the section reports each phase's median
beside the total, min / median / max over the repeats.
"""

from __future__ import annotations

import argparse
import time

from benchmarks import doc
from benchmarks.launcher import ServerProcess, health_check
from benchmarks.stats import median, spread

DRY_RUN = {"repeats": 1}
POLL_S = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--server-args", default="", help="extra server flags, space-separated")


def start_once(model: str, extra: list[str]) -> tuple[float, dict[str, float]]:
    """(seconds from exec to readiness SERVING at the client, the ready line's phases)."""
    from tokenwire_server.health import SERVING

    started = time.monotonic()
    server = ServerProcess(["--model", model, *extra], wait=False)
    try:
        server.wait_listening(600)
        while True:
            try:
                if health_check(server.target, timeout=1.0) == SERVING:
                    break
            except Exception:  # the port is open before the health service answers
                pass
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n" + server.output())
            if time.monotonic() - started > 600:
                raise RuntimeError("server did not become ready:\n" + server.output())
            time.sleep(POLL_S)
        serving = time.monotonic() - started
        deadline = time.monotonic() + 10
        while not server.find("ready") and time.monotonic() < deadline:
            time.sleep(POLL_S)
        [ready] = server.find("ready")
        return serving, dict(ready["phases"])
    finally:
        server.terminate()


def run(args: argparse.Namespace) -> doc.Section:
    extra = args.server_args.split()
    totals: list[float] = []
    phases: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        total, seen = start_once(args.model, extra)
        totals.append(total)
        for name, seconds in seen.items():
            phases.setdefault(name, []).append(seconds)
        print(f"repeat {repeat}: ready in {total:.2f} s; {seen}", flush=True)
    lines = [
        "## Start-up: exec to readiness (`make bench-startup`)",
        "",
        doc.written(args.command),
        f"{doc.host()}. Model `{args.model}`{' with ' + args.server_args if args.server_args else ''}; "
        f"{args.repeats} fresh server processes one after another, each polled every {POLL_S * 1000:.0f} ms "
        "from exec until readiness answers SERVING. Seconds: median (min–max) over the repeats; the phases are "
        "the server's own (its \"ready\" line), so their sum falls a little short of the total (log lines, the "
        "gaps between phases, the client's poll).",
        "",
        "| what | seconds |",
        "|---|---:|",
        f"| **exec → readiness SERVING** | **{spread(totals, 2)}** |",
    ]
    for name, values in phases.items():
        lines.append(f"| {name} | {spread(values, 2)} |")
    lines.append("")
    lines.append(f"- median {median(totals):.2f} s; the phases' medians add up to {sum(median(v) for v in phases.values()):.2f} s")
    return doc.Section("startup", "\n".join(lines) + "\n")
