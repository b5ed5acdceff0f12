"""Does one tenant's backlog leave another tenant served, and do weights hold? (`make bench-tenants`)"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from benchmarks import doc, load
from benchmarks.launcher import serve, tenant_flags
from benchmarks.stats import median, p99, spread

FLAGS = {"repeats": 3, "max_active": (16, "the server's --max-active (its default)"),
         "backlog": (64, "A's streams waiting beyond the slots"), "a_tokens": 128, "b_calls": 15,
         "b_every": (1.0, "seconds between B's streams"), "b_tokens": 8, "b_timeout": 20.0, "warmup": 8.0,
         "a_alone": 15.0, "window": 60.0}  # fmt: skip
DRY_RUN = {"repeats": 1, "max_active": 2, "backlog": 2, "a_tokens": 8, "b_calls": 2, "b_every": 0.05, "b_tokens": 2,
           "b_timeout": 5.0, "warmup": 0.1, "a_alone": 0.3, "window": 0.3}  # fmt: skip
TOKENS = "tok-a a\ntok-b b\n"
ONE_TENANT_TOKENS = "tok-a\ntok-b\n"  # both the default tenant: first come, first served


class Load:
    """``streams`` long streams for one tenant, each started again when it ends, until stopped;
    every token's arrival time is kept."""

    def __init__(self, stub: Any, token: str, streams: int, new_tokens: int) -> None:
        self.arrivals: list[float] = []
        self.refused = 0
        self._stop, self._calls = threading.Event(), []
        self._request = load.request("Write a long story about a lighthouse keeper and the sea.", new_tokens,
                                     ignore_eos=True, output={"token_ids": True})  # fmt: skip
        self._stub, self._token = stub, token
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            call = self._stub.Generate(self._request, metadata=load.bearer(self._token))
            self._calls.append(call)
            try:
                for chunk in call:
                    self.arrivals.extend([time.monotonic()] * len(chunk.tokens))
            except grpc.RpcError:
                if not self._stop.is_set():
                    self.refused += 1
                    time.sleep(1.0)  # refused: try again after the server's retry hint

    def tokens_between(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.arrivals) if start <= t < end)

    def stop(self) -> None:
        self._stop.set()
        for call in list(self._calls):
            call.cancel()
        for thread in self._threads:
            thread.join(30)


def paced(stub: Any, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """B's ``--b-calls`` short streams, one every ``--b-every`` seconds, each in its own thread:
    (TTFT of each that started, server queue time of each that finished, misses)."""
    request = load.request("The capital of France is", args.b_tokens, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(args.b_calls) as pool:
        calls = []
        for _ in range(args.b_calls):
            calls.append(pool.submit(load.stream, stub, request, args.b_timeout, load.bearer("tok-b"), catch=True))
            time.sleep(args.b_every)
        got = [call.result() for call in calls]
    if codes := sorted(s.error.code().name for s in got if s.error is not None):
        doc.log(f"  B calls that failed: {', '.join(codes)}")
    ttft = [s.ttft for s in got if s.ttft is not None]
    queue = [c.usage.queue_time_ms / 1000 for s in got for c in s.chunks if c.HasField("usage")]
    return ttft, queue, len(got) - len(ttft)


@contextmanager
def server(folder: Path, args: argparse.Namespace, tokens: str, tenants: str | None) -> Iterator[Any]:
    flags = ["--model", args.model, "--max-queue", str(args.backlog + 16), *tenant_flags(folder, tokens, tenants)]
    with serve(args.dry_run, flags) as proc, grpc.insecure_channel(proc.target) as channel:
        yield load.stub(channel)


def fair_share(stub: Any, args: argparse.Namespace) -> dict[str, float]:
    idle, _, _ = paced(stub, args)
    backlog = Load(stub, "tok-a", args.max_active + args.backlog, args.a_tokens)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    time.sleep(args.a_alone)
    t1 = time.monotonic()
    loaded, queue, misses = paced(stub, args)
    t2 = time.monotonic()
    backlog.stop()
    assert not backlog.refused, f"A was refused {backlog.refused} times: the server's queue is smaller than its backlog"
    every = loaded + [args.b_timeout] * misses  # a miss counts as the whole wait
    return {
        "idle_p50": median(idle), "idle_p99": p99(idle), "loaded_p50": median(every), "loaded_p99": p99(every),
        "queue_p99": p99(queue) if queue else float("nan"), "misses": misses,
        "a_alone": backlog.tokens_between(t0, t1) / (t1 - t0), "a_beside": backlog.tokens_between(t1, t2) / (t2 - t1),
    }  # fmt: skip


def weights(stub: Any, args: argparse.Namespace) -> dict[str, float]:
    # Each tenant keeps half of what the server holds open (slots + queue): both stay
    # backlogged, and nobody is refused (a storm of refused retries would measure the
    # refusals, not the sharing).
    streams = (args.max_active + args.backlog + 16) // 2
    a, b = Load(stub, "tok-a", streams, args.a_tokens), Load(stub, "tok-b", streams, args.a_tokens)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    time.sleep(args.window)
    t1 = time.monotonic()
    a.stop()
    b.stop()
    ta, tb = a.tokens_between(t0, t1), b.tokens_between(t0, t1)
    return {"a": ta / (t1 - t0), "b": tb / (t1 - t0), "ratio": ta / max(tb, 1), "refused": a.refused + b.refused}


def run(args: argparse.Namespace) -> doc.Section:
    fair: dict[str, list[dict[str, float]]] = {"fair": [], "fcfs": []}
    weighted: list[dict[str, float]] = []
    servers = (("fair", TOKENS, "[tenants.a]\nweight = 1\n[tenants.b]\nweight = 1\n"),
               ("fcfs", ONE_TENANT_TOKENS, None),
               ("weights 3:1", TOKENS, "[tenants.a]\nweight = 3\n[tenants.b]\nweight = 1\n"))  # fmt: skip
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            for mode, tokens, tenants in servers:
                with server(Path(tmp), args, tokens, tenants) as stub:
                    result = weights(stub, args) if mode == "weights 3:1" else fair_share(stub, args)
                (weighted if mode == "weights 3:1" else fair[mode]).append(result)
                doc.log(f"repeat {repeat} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))

    def col(mode: str, key: str, scale: float = 1.0, digits: int = 0) -> str:
        return spread([r[key] * scale for r in fair[mode] if r[key] == r[key]], digits)  # nan: no B call finished

    rows = [[title, f"{col(mode, 'idle_p50', 1000)} / {col(mode, 'idle_p99', 1000)}",
             f"{col(mode, 'loaded_p50', 1000)} / {col(mode, 'loaded_p99', 1000)}", col(mode, "queue_p99", 1000),
             col(mode, "misses"), col(mode, "a_alone", 1, 1), col(mode, "a_beside", 1, 1)]
            for mode, title in (("fair", "tenants, weights 1:1"),
                                ("fcfs", "one tenant (first come, first served)"))]  # fmt: skip
    ttft_ratio = [r["loaded_p99"] / r["idle_p99"] for r in fair["fair"]]
    a_share = [r["a_beside"] / r["a_alone"] for r in fair["fair"]]
    fcfs_ratio = [r["loaded_p99"] / r["idle_p99"] for r in fair["fcfs"]]
    ratios = [r["ratio"] for r in weighted]
    return doc.section(
        "tenants", "Tenants: fair share, and weights (`make bench-tenants`)", args.command,
        f"The default model over gRPC, batched engine, `--max-active {args.max_active}`, {doc.host()}. Tenant A keeps "
        f"{args.max_active + args.backlog} streams of {args.a_tokens} tokens open ({args.backlog} waiting); tenant B "
        f"sends one {args.b_tokens}-token stream every {args.b_every:g} s, {args.b_calls} in all. Median (min–max) "
        f"over {args.repeats} repeats of each repeat's figure; a B stream that had not started after "
        f"{args.b_timeout:.0f} s counts as that long.",
        "",
        *doc.table("admission | B TTFT idle p50 / p99 (ms) | B TTFT beside A's backlog p50 / p99 (ms) | "
                   "B server queue p99 (ms) | B misses | A tok/s alone | A tok/s beside B", "lllrrrr", rows),
        "",
        f"- B's TTFT p99 beside A's backlog ÷ on an idle server: tenants {spread(ttft_ratio, 2)}× (target ≤ 2×: "
        f"{'met' if median(ttft_ratio) <= 2 else 'missed'}); first come, first served {spread(fcfs_ratio, 1)}×",
        f"- A's throughput beside B ÷ alone: {spread(a_share, 2)} (target ≥ 0.5: "
        f"{'met' if median(a_share) >= 0.5 else 'missed'})",
        "",
        f"Weights 3:1, both tenants saturating ({(args.max_active + args.backlog + 16) // 2} streams each; refused: "
        f"{sum(r['refused'] for r in weighted):.0f}), tokens over {args.window:.0f} s after {args.warmup:.0f} s of "
        "warm-up:",
        "",
        *doc.table("tenant | tok/s", "lr", [["A (weight 3)", spread([r["a"] for r in weighted], 1)],
                                           ["B (weight 1)", spread([r["b"] for r in weighted], 1)]]),
        "",
        f"- A ÷ B: {spread(ratios, 2)} (target 3 ± 15 %, 2.55–3.45: "
        f"{'met' if 2.55 <= median(ratios) <= 3.45 else 'missed'})",
    )  # fmt: skip
