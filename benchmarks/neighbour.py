"""Does the server keep its pace when another process wants a core? (`make bench-neighbour`)

Between torch's parallel regions an idle libgomp thread spins for GOMP_SPINCOUNT iterations; a
thread that lost its core to a neighbour holds every later step at the barrier.
`--omp-spin-count 1000` (the default) against `0` (OpenMP's own spin), each quiet and beside one
busy Python process, at c=1 and c=16. Replaces the "neighbour" section.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import grpc
from tokenwire.v1 import generation_pb2 as pb

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, ratios, spread

SETTINGS = {"1000 (default)": "1000", "OpenMP's own (0)": "0"}
PROMPT = "Tell me a story about a cat who learns to sail."
FLAGS = {"repeats": 3, "tokens": 64, "concurrency": "1,16", "rounds": (3, "waves of streams per cell")}
DRY_RUN = {"repeats": 1, "rounds": 1, "concurrency": "1,2", "tokens": 4}


def measure(target: str, concurrency: int, tokens: int, rounds: int) -> tuple[float, list[float]]:
    """Tokens/s over ``rounds`` waves of ``concurrency`` streams, and every stream's seconds."""
    request = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True))
    with grpc.insecure_channel(target) as channel:
        stub = load.stub(channel)
        load.stream(stub, request)  # warm
        start = time.perf_counter()
        done = [s for _ in range(rounds) for s in load.streams(stub, [request] * concurrency, concurrency, 600)[1]]
        seconds = time.perf_counter() - start
    assert all(s.usage.completion_tokens == tokens for s in done)
    return rounds * concurrency * tokens / seconds, [s.seconds for s in done]


def run(args: argparse.Namespace) -> doc.Section:
    levels = [int(c) for c in args.concurrency.split(",")]
    os.environ.pop("GOMP_SPINCOUNT", None)  # the servers' flag decides, not this shell
    # (setting, neighbour, concurrency) -> per-repeat tokens/s, and all latencies
    tps: dict[tuple[str, bool, int], list[float]] = {}
    lat: dict[tuple[str, bool, int], list[float]] = {}
    for repeat in range(args.repeats):
        for name, spin in SETTINGS.items():
            with serve(args.dry_run, ["--model", args.model, "--omp-spin-count", spin]) as server:
                reported = server.find("torch")[0]["omp_spin_count"]
                assert reported == (spin if spin != "0" else "openmp-default"), reported
                for neighbour in (False, True):
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
                    try:
                        for c in levels:
                            rate, latencies = measure(server.target, c, args.tokens, args.rounds)
                            tps.setdefault((name, neighbour, c), []).append(rate)
                            lat.setdefault((name, neighbour, c), []).extend(latencies)
                            doc.log(f"repeat {repeat} spin {reported} neighbour={neighbour} c={c}: {rate:.1f} tok/s")
                    finally:
                        if hog:
                            hog.kill()
                            hog.wait()
    busy = {False: "none", True: "busy"}
    rows = [[name, busy[neighbour], c, spread(tps[(name, neighbour, c)]),
             f"{median(lat[(name, neighbour, c)]):.2f} / {p99(lat[(name, neighbour, c)]):.2f}"]
            for c in levels for neighbour in (False, True) for name in SETTINGS]  # fmt: skip
    default, own = SETTINGS
    notes = [
        f"- c={c}, neighbour {busy[neighbour]}: spin 1000 vs OpenMP's own, tokens/s ratio "
        f"{spread(ratios(tps[(default, neighbour, c)], tps[(own, neighbour, c)]), 2)}×"
        for c in levels
        for neighbour in (False, True)
    ]
    notes += [f"- {name}, c={c}: pace kept beside the neighbour (busy ÷ quiet tokens/s) "
              f"{spread(ratios(tps[(name, True, c)], tps[(name, False, c)]), 2)}"
              for name in SETTINGS for c in levels]  # fmt: skip
    return doc.section(
        "neighbour", "Beside a busy neighbour: OpenMP's spin (`make bench-neighbour`)", args.command,
        f"The default model over gRPC, {doc.host()}; streams of {args.tokens} tokens, {args.rounds} waves per cell, "
        f"{args.repeats} repeats alternating the settings. The neighbour is one `while True: pass` process. "
        "Tokens/s: median (min–max) over repeats; latency: median and p99 over every stream of the cell.",
        "",
        *doc.table("--omp-spin-count | neighbour | streams | tokens/s | stream latency median / p99 (s)", "llrrr",
                   rows),
        "",
        *notes,
    )  # fmt: skip
