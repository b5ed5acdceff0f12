"""Does one tenant's backlog leave another tenant served, and do weights hold? (`make bench-tenants`)

The default model over gRPC on 127.0.0.1, two tenants told apart by their bearer tokens.
Each repeat runs three servers, one after another:

- **fair** (`--tenant-config`, weights 1:1): first B alone sends one short stream a second
  (its time to first token on an idle server); then A alone keeps `--max-active` + 64 long
  streams open, so 64 wait (A's throughput alone); then B sends one a second again
  while A keeps its backlog (B's time to first token, and A's throughput, beside each other).
- **fcfs**: the same, with both tokens in the one default tenant: first come, first served
  (how it was before tenants), for comparison. B's streams that do not start within
  `--b-timeout` seconds count as misses.
- **weights** (`--tenant-config`, weights 3:1): both tenants keep as many long streams open
  as A does above, for `--window` seconds after a warm-up; each tenant's tokens in the
  window, and their ratio.

Every token is counted at the client as it arrives (`output.token_ids`). Three repeats;
medians (min–max) over the repeats of each repeat's figure; ratios are taken inside each
repeat. Replaces the "tenants" section.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, spread

DRY_RUN = {"repeats": 1, "max_active": 2, "backlog": 2, "a_tokens": 8, "b_calls": 2, "b_every": 0.05, "b_tokens": 2,
           "b_timeout": 5.0, "warmup": 0.1, "a_alone": 0.3, "window": 0.3}  # fmt: skip
TOKENS = "tok-a a\ntok-b b\n"
ONE_TENANT_TOKENS = "tok-a\ntok-b\n"  # both the default tenant: first come, first served


def auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


class Load:
    """``streams`` long streams for one tenant, each started again when it ends, until stopped;
    every token's arrival time is kept."""

    def __init__(self, stub: Any, token: str, streams: int, new_tokens: int) -> None:
        from tokenwire.v1 import generation_pb2 as pb

        self.arrivals: list[float] = []
        self.refused = 0
        self._stop = threading.Event()
        self._calls: list[Any] = []
        self._lock = threading.Lock()
        self._request = pb.GenerateRequest(
            prompt="Write a long story about a lighthouse keeper and the sea.",
            stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
            output=pb.OutputOptions(token_ids=True),
        )
        self._stub, self._token = stub, token
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        import grpc

        while not self._stop.is_set():
            call = self._stub.Generate(self._request, metadata=auth(self._token))
            with self._lock:
                self._calls.append(call)
            try:
                for chunk in call:
                    now = time.monotonic()
                    self.arrivals.extend([now] * len(chunk.tokens))
            except grpc.RpcError:
                if not self._stop.is_set():
                    self.refused += 1
                    time.sleep(1.0)  # refused: try again after the server's retry hint

    def tokens_between(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.arrivals) if start <= t < end)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for call in self._calls:
                call.cancel()
        for thread in self._threads:
            thread.join(30)


def paced(
    stub: Any, token: str, count: int, new_tokens: int, timeout_s: float, every: float
) -> tuple[list[float], list[float], int]:
    """``count`` short streams, one every ``every`` seconds, each in its own thread: (TTFT of each that
    started, server queue time of each that finished, misses)."""
    import grpc
    from tokenwire.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        prompt="The capital of France is", stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True)
    )
    ttft: list[float] = []
    queue: list[float] = []
    misses = [0]
    codes: list[str] = []

    def one() -> None:
        start = time.monotonic()
        first = None
        try:
            for chunk in stub.Generate(request, metadata=auth(token), timeout=timeout_s):
                if first is None:
                    first = time.monotonic() - start
                if chunk.HasField("usage"):
                    queue.append(chunk.usage.queue_time_ms / 1000)
        except grpc.RpcError as error:
            codes.append(error.code().name)
        if first is None:
            misses[0] += 1
        else:
            ttft.append(first)

    threads = []
    for _ in range(count):
        threads.append(threading.Thread(target=one, daemon=True))
        threads[-1].start()
        time.sleep(every)
    for thread in threads:
        thread.join(timeout_s + 5)
    if codes:
        print(f"  B calls that failed: {', '.join(sorted(codes))}", flush=True)
    return ttft, queue, misses[0]


@contextmanager
def server(folder: Path, args: argparse.Namespace, tokens: str, tenants: str | None) -> Iterator[Any]:
    import grpc

    (folder / "tokens").write_text(tokens)
    flags = ["--model", args.model, "--auth-token-file", str(folder / "tokens"), "--max-queue", str(args.backlog + 16)]
    if tenants is not None:
        (folder / "tenants.toml").write_text(tenants)
        flags += ["--tenant-config", str(folder / "tenants.toml")]
    with serve(args.dry_run, flags) as proc, grpc.insecure_channel(proc.target) as channel:
        yield load.stub(channel)


def fair_share(stub: Any, args: argparse.Namespace) -> dict[str, float]:
    idle, _, _ = paced(stub, "tok-b", args.b_calls, args.b_tokens, args.b_timeout, args.b_every)
    load = Load(stub, "tok-a", args.max_active + args.backlog, args.a_tokens)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    time.sleep(args.a_alone)
    t1 = time.monotonic()
    loaded, queue, misses = paced(stub, "tok-b", args.b_calls, args.b_tokens, args.b_timeout, args.b_every)
    t2 = time.monotonic()
    load.stop()
    assert load.refused == 0, f"A was refused {load.refused} times: the server's queue is smaller than A's backlog"
    alone_rate = load.tokens_between(t0, t1) / (t1 - t0)
    beside_rate = load.tokens_between(t1, t2) / (t2 - t1)
    every = loaded + [args.b_timeout] * misses  # a miss counts as the whole wait
    return {
        "idle_p50": median(idle),
        "idle_p99": p99(idle),
        "loaded_p50": median(every),
        "loaded_p99": p99(every),
        "queue_p99": p99(queue) if queue else float("nan"),
        "misses": misses,
        "a_alone": alone_rate,
        "a_beside": beside_rate,
    }


def weights(stub: Any, args: argparse.Namespace) -> dict[str, float]:
    # Each tenant keeps half of what the server holds open (slots + queue): both stay
    # backlogged, and nobody is refused (a storm of refused retries would measure the
    # refusals, not the sharing).
    streams = (args.max_active + args.backlog + 16) // 2
    a = Load(stub, "tok-a", streams, args.a_tokens)
    b = Load(stub, "tok-b", streams, args.a_tokens)
    time.sleep(args.warmup)
    t0 = time.monotonic()
    time.sleep(args.window)
    t1 = time.monotonic()
    a.stop()
    b.stop()
    ta, tb = a.tokens_between(t0, t1), b.tokens_between(t0, t1)
    return {"a": ta / (t1 - t0), "b": tb / (t1 - t0), "ratio": ta / max(tb, 1), "refused": a.refused + b.refused}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-active", type=int, default=16, help="the server's --max-active (its default)")
    parser.add_argument("--backlog", type=int, default=64, help="A's streams waiting beyond the slots")
    parser.add_argument("--a-tokens", type=int, default=128)
    parser.add_argument("--b-calls", type=int, default=15)
    parser.add_argument("--b-every", type=float, default=1.0, help="seconds between B's streams")
    parser.add_argument("--b-tokens", type=int, default=8)
    parser.add_argument("--b-timeout", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--a-alone", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=60.0)


def run(args: argparse.Namespace) -> doc.Section:
    fair: dict[str, list[dict[str, float]]] = {"fair": [], "fcfs": []}
    weighted: list[dict[str, float]] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            for mode in ("fair", "fcfs"):
                tenants = "[tenants.a]\nweight = 1\n[tenants.b]\nweight = 1\n" if mode == "fair" else None
                with server(folder, args, TOKENS if mode == "fair" else ONE_TENANT_TOKENS, tenants) as stub:
                    result = fair_share(stub, args)
                fair[mode].append(result)
                print(f"repeat {repeat} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
            with server(folder, args, TOKENS, "[tenants.a]\nweight = 3\n[tenants.b]\nweight = 1\n") as stub:
                result = weights(stub, args)
            weighted.append(result)
            print(f"repeat {repeat} weights 3:1: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)

    def col(mode: str, key: str, scale: float = 1.0, digits: int = 0) -> str:
        values = [r[key] * scale for r in fair[mode] if r[key] == r[key]]  # nan: no B call finished
        return spread(values, digits)

    lines = [
        "## Tenants: fair share, and weights (`make bench-tenants`)",
        "",
        doc.written(args.command),
        f"The default model over gRPC, batched engine, `--max-active {args.max_active}`, {doc.host()}. Tenant A keeps {args.max_active + args.backlog} "
        f"streams of {args.a_tokens} tokens open ({args.backlog} waiting); tenant B sends one {args.b_tokens}-token stream "
        f"every {args.b_every:g} s, {args.b_calls} in all. Median (min–max) over {args.repeats} repeats of each repeat's figure; "
        f"a B stream that had not started after {args.b_timeout:.0f} s counts as that long.",
        "",
        "| admission | B TTFT idle p50 / p99 (ms) | B TTFT beside A's backlog p50 / p99 (ms) | B server queue p99 (ms) | B misses | A tok/s alone | A tok/s beside B |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for mode, title in (("fair", "tenants, weights 1:1"), ("fcfs", "one tenant (first come, first served)")):
        lines.append(
            f"| {title} | {col(mode, 'idle_p50', 1000)} / {col(mode, 'idle_p99', 1000)} | {col(mode, 'loaded_p50', 1000)} / "
            f"{col(mode, 'loaded_p99', 1000)} | {col(mode, 'queue_p99', 1000)} | {col(mode, 'misses')} | {col(mode, 'a_alone', 1, 1)} | "
            f"{col(mode, 'a_beside', 1, 1)} |"
        )
    ttft_ratio = [r["loaded_p99"] / r["idle_p99"] for r in fair["fair"]]
    a_share = [r["a_beside"] / r["a_alone"] for r in fair["fair"]]
    fcfs_ratio = [r["loaded_p99"] / r["idle_p99"] for r in fair["fcfs"]]
    ratios = [r["ratio"] for r in weighted]
    lines += [
        "",
        f"- B's TTFT p99 beside A's backlog ÷ on an idle server: tenants {spread(ttft_ratio, 2)}× (target ≤ 2×: "
        f"{'met' if median(ttft_ratio) <= 2 else 'missed'}); first come, first served {spread(fcfs_ratio, 1)}×",
        f"- A's throughput beside B ÷ alone: {spread(a_share, 2)} (target ≥ 0.5: {'met' if median(a_share) >= 0.5 else 'missed'})",
        "",
        f"Weights 3:1, both tenants saturating ({(args.max_active + args.backlog + 16) // 2} streams each; refused: "
        f"{sum(r['refused'] for r in weighted):.0f}), tokens over {args.window:.0f} s after {args.warmup:.0f} s of warm-up:",
        "",
        "| tenant | tok/s |",
        "|---|---:|",
        f"| A (weight 3) | {spread([r['a'] for r in weighted], 1)} |",
        f"| B (weight 1) | {spread([r['b'] for r in weighted], 1)} |",
        "",
        f"- A ÷ B: {spread(ratios, 2)} (target 3 ± 15 %, 2.55–3.45: {'met' if 2.55 <= median(ratios) <= 3.45 else 'missed'})",
    ]
    return doc.Section("tenants", "\n".join(lines) + "\n")
