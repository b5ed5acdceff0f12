"""Does the server keep its pace when another process wants a core? (`make bench-neighbour`)"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, ratios, spread

CORES = str(len(os.sched_getaffinity(0)))
# name -> (--omp-spin-count, --torch-threads): 0 threads lets the engine choose (the default)
SETTINGS = {
    "spin 10000, threads by measurement (default)": ("10000", "0"),
    f"spin 10000, {CORES} threads pinned": ("10000", CORES),
    f"spin 1000, {CORES} threads pinned (the old default)": ("1000", CORES),
}
PROMPT = "Tell me a story about a cat who learns to sail."
FLAGS = {"repeats": 3, "tokens": 64, "concurrency": "1,16", "rounds": (3, "waves of streams per cell")}
DRY_RUN = {"repeats": 1, "rounds": 1, "concurrency": "1,2", "tokens": 4}


def measure(stub: object, concurrency: int, tokens: int, rounds: int) -> tuple[float, list[float]]:
    """Tokens/s over ``rounds`` waves of ``concurrency`` streams, and every stream's seconds."""
    request = load.request(PROMPT, tokens, ignore_eos=True)
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
    switches = dict.fromkeys(SETTINGS, 0)  # the layout's changes of thread count, over every repeat
    for repeat in range(args.repeats):
        for name, (spin, threads) in SETTINGS.items():
            flags = ["--model", args.model, "--omp-spin-count", spin, "--torch-threads", threads]
            with serve(args.dry_run, flags) as server:
                stub = load.stub(server.target)
                reported = server.find("torch")[0]["omp_spin_count"]
                assert reported == spin, reported
                for neighbour in (False, True):
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
                    try:
                        for c in levels:
                            rate, latencies = measure(stub, c, args.tokens, args.rounds)
                            tps.setdefault((name, neighbour, c), []).append(rate)
                            lat.setdefault((name, neighbour, c), []).extend(latencies)
                            doc.log(f"repeat {repeat} {name} neighbour={neighbour} c={c}: {rate:.1f} tok/s")
                    finally:
                        if hog:
                            hog.kill()
                            hog.wait()
                switches[name] += len(server.find("cpu step threads"))
    busy = {False: "none", True: "busy"}
    rows = [[name, busy[n], c, spread(tps[key]), f"{median(lat[key]):.2f} / {p99(lat[key]):.2f}"]
            for c in levels for n in (False, True) for name in SETTINGS for key in [(name, n, c)]]  # fmt: skip
    default, *others = SETTINGS
    notes = [
        f"- c={c}, neighbour {busy[n]}: the default vs {other}, tokens/s ratio "
        f"{spread(ratios(tps[(default, n, c)], tps[(other, n, c)]), 2)}×"
        for other in others
        for c in levels
        for n in (False, True)
    ]
    notes.append(
        f"- the default's changes of thread count (log line `cpu step threads`), all repeats: {switches[default]}"
    )
    notes += [f"- {name}, c={c}: pace kept beside the neighbour (busy ÷ quiet tokens/s) "
              f"{spread(ratios(tps[(name, True, c)], tps[(name, False, c)]), 2)}"
              for name in SETTINGS for c in levels]  # fmt: skip
    return doc.section(
        "neighbour", "Beside a busy neighbour: OpenMP's spin and the step's threads (`make bench-neighbour`)",
        args.command,
        f"The default model over gRPC, {doc.host()}; streams of {args.tokens} tokens, {args.rounds} waves per cell, "
        f"{args.repeats} repeats alternating the settings. The neighbour is one `while True: pass` process. "
        "Tokens/s: median (min–max) over repeats; latency: median and p99 over every stream of the cell.",
        "",
        *doc.table("setting | neighbour | streams | tokens/s | stream latency median / p99 (s)", "llrrr", rows),
        "",
        *notes,
    )  # fmt: skip
