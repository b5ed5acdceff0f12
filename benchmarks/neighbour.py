"""`make bench-neighbour`: does the server keep its pace when another process wants a core?

torch computes with one OpenMP thread per core. Between parallel regions an idle libgomp
thread spins for GOMP_SPINCOUNT iterations before it sleeps; with its default spin, a
thread that has lost its core to a neighbour (another pod on the node, a CPU limit, a
test runner) holds every later step at the barrier until the scheduler gives the core
back. `--omp-spin-count` (default 1000) shortens the spin; this measures what it costs
on a quiet host and what it saves beside a busy one.

Two servers on the default model, one with `--omp-spin-count 1000` (the default) and one
with `--omp-spin-count 0` (OpenMP's own spin), each measured quiet and beside one busy
Python process (`while True: pass`, one core's worth), at c=1 and c=16 streams of 64
tokens. Three repeats alternate the settings; the section reports median (min–max) of
tokens/s and per-stream latency, and the per-repeat ratios. The result replaces the
"neighbour" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench import machine
from benchmarks.doc import replace_section
from benchmarks.launcher import ServerProcess
from benchmarks.peers import spread

SECTION = "neighbour"
SETTINGS = {"1000 (default)": "1000", "OpenMP's own (0)": "0"}
PROMPT = "Tell me a story about a cat who learns to sail."


def measure(target: str, concurrency: int, tokens: int, rounds: int) -> tuple[float, list[float]]:
    """Tokens/s over ``rounds`` waves of ``concurrency`` streams, and every stream's seconds."""
    import grpc
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True)
    )
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)

        def one(_: int) -> float:
            start = time.perf_counter()
            chunks = list(stub.Generate(request, timeout=600))
            assert chunks[-1].usage.completion_tokens == tokens
            return time.perf_counter() - start

        one(0)  # warm
        latencies: list[float] = []
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for _ in range(rounds):
                latencies += pool.map(one, range(concurrency))
        return rounds * concurrency * tokens / (time.perf_counter() - start), latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=3, help="waves of streams per cell")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    os.environ.pop("GOMP_SPINCOUNT", None)  # the servers' flag decides, not this shell

    # (setting, neighbour, concurrency) -> per-repeat tokens/s, and all latencies
    tps: dict[tuple[str, bool, int], list[float]] = {}
    lat: dict[tuple[str, bool, int], list[float]] = {}
    for repeat in range(args.repeats):
        for name, spin in SETTINGS.items():
            server_args = ["--model", args.model, "--omp-spin-count", spin]
            with ServerProcess(server_args) as server:
                reported = server.find("torch")[0]["omp_spin_count"]
                assert reported == (spin if spin != "0" else "openmp-default"), reported
                for neighbour in (False, True):
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
                    try:
                        for c in levels:
                            rate, latencies = measure(server.target, c, args.tokens, args.rounds)
                            tps.setdefault((name, neighbour, c), []).append(rate)
                            lat.setdefault((name, neighbour, c), []).extend(latencies)
                            print(
                                f"repeat {repeat} spin {reported} neighbour={neighbour} c={c}: {rate:.1f} tok/s",
                                flush=True,
                            )
                    finally:
                        if hog:
                            hog.kill()
                            hog.wait()

    info = machine()
    command = "python -m benchmarks.neighbour " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## Beside a busy neighbour: OpenMP's spin (`make bench-neighbour`)",
        "",
        f"Written by `{command.strip()}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; do not edit by hand.",
        f"The default model over gRPC, {info['cpu']}, {info['cores']} cores, torch {info['torch']}; streams of "
        f"{args.tokens} tokens, {args.rounds} waves per cell, {args.repeats} repeats alternating the settings. "
        "The neighbour is one `while True: pass` process. Tokens/s: median (min–max) over repeats; "
        "latency: median and p99 over every stream of the cell.",
        "",
        "| --omp-spin-count | neighbour | streams | tokens/s | stream latency median / p99 (s) |",
        "|---|---|---:|---:|---:|",
    ]
    for c in levels:
        for neighbour in (False, True):
            for name in SETTINGS:
                values = sorted(lat[(name, neighbour, c)])
                p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
                lines.append(
                    f"| {name} | {'busy' if neighbour else 'none'} | {c} | {spread(tps[(name, neighbour, c)])} "
                    f"| {statistics.median(values):.2f} / {p99:.2f} |"
                )
    lines.append("")
    default, own = SETTINGS
    for c in levels:
        for neighbour in (False, True):
            ratios = [
                a / b for a, b in zip(tps[(default, neighbour, c)], tps[(own, neighbour, c)], strict=True)
            ]
            lines.append(
                f"- c={c}, neighbour {'busy' if neighbour else 'none'}: spin 1000 vs OpenMP's own, tokens/s ratio "
                f"{spread(ratios, 2)}×"
            )
    for name in SETTINGS:
        for c in levels:
            kept = [b / a for a, b in zip(tps[(name, False, c)], tps[(name, True, c)], strict=True)]
            lines.append(
                f"- {name}, c={c}: pace kept beside the neighbour (busy ÷ quiet tokens/s) {spread(kept, 2)}"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    replace_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
