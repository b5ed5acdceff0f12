"""`make soak`: minutes of mixed traffic against one server, then its figures.

Starts a server on 127.0.0.1 (the default model unless ``--model``), or targets a running
one (``--target``, with ``--pid`` for its memory and threads). From this one process it
sends a bounded rate of mixed calls: short and long generations, about 20% cancelled
mid-stream, 10% malformed, a few with a deadline too short to finish, and every
``--burst-every`` seconds a burst past the admission limit (active + queued); after the
mix, a cancel storm (``--cancel-storm`` streams cancelled after their first chunk). Then it
reports the calls by status, checks that none ended UNKNOWN or INTERNAL, compares the
server's resident memory and thread count at the start and the end, and gives the client's
time-to-first-token percentiles. ``--write-doc`` writes the figures into docs/reliability.md.

Traffic goes to 127.0.0.1 (or ``--target``) only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from tokenwire.bench import percentile
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

from benchmarks.launcher import ServerProcess, process_status

PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Translate 'good morning' into French, German and Spanish.",
    "What is the capital of Japan? Answer briefly.",
    "Tell me a short story about a robot who learns to paint.",
)
MALFORMED = (
    pb.GenerateRequest(),
    pb.GenerateRequest(prompt=""),
    pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0)),
    pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(max_new_tokens=0)),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(max_new_tokens=2**32 - 1)),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(stop_sequences=[""])),
    pb.GenerateRequest(prompt="hi", output=pb.OutputOptions(top_logprobs=99)),
    pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**31])),
    pb.GenerateRequest(prompt="nul \x00 inside"),
)
BAD_CODES = ("UNKNOWN", "INTERNAL")


@dataclasses.dataclass
class Outcome:
    kind: str
    code: str
    ttft_s: float | None = None
    tokens: int = 0


class Traffic:
    """Sends the mix and records what came back; thread-safe."""

    def __init__(self, stub: pb_grpc.TextGenerationStub, args: argparse.Namespace, rng: random.Random) -> None:
        self._stub = stub
        self._args = args
        self._rng = rng
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.skipped = 0

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def _generation(self, tokens: int) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=self._rng.choice(PROMPTS),
            sampling=pb.SamplingParams(temperature=0.7, seed=self._rng.randrange(2**32)),
            stopping=pb.StoppingCriteria(max_new_tokens=tokens),
        )

    def pick(self) -> tuple[str, pb.GenerateRequest, float]:
        """The next call: its kind, request and deadline in seconds."""
        roll = self._rng.random()
        a = self._args
        if roll < 0.10:
            return "malformed", self._rng.choice(MALFORMED), 10.0
        if roll < 0.30:
            return "cancelled", self._generation(a.long_tokens), 120.0
        if roll < 0.35:
            return "short-deadline", self._generation(a.long_tokens), 0.2
        if roll < 0.50:
            return "long", self._generation(a.long_tokens), 120.0
        return "short", self._generation(a.short_tokens), 60.0

    def run_one(self, kind: str, request: pb.GenerateRequest, timeout: float) -> None:
        started = time.monotonic()
        ttft = None
        tokens = 0
        cancel_after = self._rng.randint(1, 6) if kind == "cancelled" else None
        call = self._stub.Generate(request, timeout=timeout)
        try:
            for count, chunk in enumerate(call, 1):
                if ttft is None:
                    ttft = time.monotonic() - started
                if chunk.HasField("usage"):
                    tokens = chunk.usage.completion_tokens
                if cancel_after is not None and count >= cancel_after:
                    call.cancel()
                    self._record(Outcome(kind, "CANCELLED", ttft))
                    return
            self._record(Outcome(kind, "OK", ttft, tokens))
        except grpc.RpcError as error:
            self._record(Outcome(kind, error.code().name, ttft))

    def burst(self, size: int) -> None:
        """Start ``size`` calls at once (past admission), then read them all."""
        calls = [self._stub.Generate(self._generation(self._args.burst_tokens), timeout=120) for _ in range(size)]
        for call in calls:
            try:
                chunks = list(call)
                self._record(Outcome("burst", "OK", None, chunks[-1].usage.completion_tokens if chunks else 0))
            except grpc.RpcError as error:
                self._record(Outcome("burst", error.code().name))


def soak(args: argparse.Namespace) -> dict[str, Any]:
    server: ServerProcess | None = None
    if args.target:
        target, pid = args.target, args.pid
    else:
        server_args = ["--model", args.model, *args.server_arg]
        print(f"soak: starting tokenwire-server {' '.join(server_args)}", file=sys.stderr, flush=True)
        server = ServerProcess(server_args, ready_timeout=600)
        target, pid = server.target, server.proc.pid
    try:
        return _drive(args, target, pid, server)
    finally:
        if server is not None:
            server.terminate(timeout=120)
            server.kill()


def _drive(args: argparse.Namespace, target: str, pid: int | None, server: ServerProcess | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.TextGenerationStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    admission = info.max_active_streams + info.max_queued_requests
    burst_size = admission + max(8, admission // 4)
    traffic = Traffic(stub, args, rng)
    # A few calls first so lazily grown pools are at their working size before the start figures.
    tokenize = [stub.Tokenize.future(pb.TokenizeRequest(text="warm up " * 200), timeout=120) for _ in range(8)]
    for future in tokenize:
        future.result()
    for _ in range(4):
        traffic.run_one("warm-up", traffic._generation(args.short_tokens), 120)
    traffic.outcomes.clear()
    warm_lines = len(server.find("request finished")) if server is not None else 0
    start_status = process_status(pid) if pid else {}
    print(
        f"soak: {args.minutes:g} min at {args.rate:g} calls/s against {target} "
        f"({info.name}, {info.engine}, admission {info.max_active_streams}+{info.max_queued_requests}, "
        f"bursts of {burst_size} every {args.burst_every:g} s)",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    end = started + args.minutes * 60
    next_burst = started + min(args.burst_every, args.minutes * 30)  # at least one burst in a short run
    next_report = started + 30
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrency, thread_name_prefix="soak")
    pending: set[concurrent.futures.Future[None]] = set()
    sent = 0
    try:
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_burst:
                next_burst = now + args.burst_every
                pending.add(pool.submit(traffic.burst, burst_size))
            pending = {f for f in pending if not f.done()}
            sent += 1
            if len(pending) < args.concurrency:
                kind, request, timeout = traffic.pick()
                pending.add(pool.submit(traffic.run_one, kind, request, timeout))
            else:  # the client's own bound on calls in flight, not the server's: this slot is skipped
                traffic.skipped += 1
            if now >= next_report:
                next_report = now + 30
                codes = collections.Counter(o.code for o in list(traffic.outcomes))
                print(f"soak: {now - started:5.0f} s  {dict(codes)}", file=sys.stderr, flush=True)
            time.sleep(max(0.0, started + sent / args.rate - time.monotonic()))
    finally:
        concurrent.futures.wait(pending, timeout=180)
        pool.shutdown(wait=False, cancel_futures=True)
    elapsed = time.monotonic() - started
    storm = _cancel_storm(traffic, args, pid)
    time.sleep(2)  # let the server retire what was cancelled last
    end_status = process_status(pid) if pid else {}
    server_codes: dict[str, int] = {}
    server_tokens = None
    server_ttfts: list[float] = []
    if server is not None:
        finished = server.find("request finished")[warm_lines:]
        server_codes = dict(collections.Counter(r.get("code", "?") for r in finished))
        server_tokens = sum(int(r.get("completion_tokens", 0)) for r in finished)
        server_ttfts = [r["ttft_ms"] / 1000 for r in finished if r.get("code") == "OK" and "ttft_ms" in r]
    channel.close()
    outcomes = list(traffic.outcomes)
    by_code = collections.Counter(o.code for o in outcomes)
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (kind, code), count in collections.Counter((o.kind, o.code) for o in outcomes).items():
        by_kind[kind][code] = count
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.code in ("OK", "CANCELLED")]
    return {
        "date": datetime.date.today().isoformat(),
        "host": f"{platform.machine()}, {_cpus()} CPUs",
        "model": info.name,
        "engine": info.engine,
        "device": info.device,
        "admission": f"{info.max_active_streams} active + {info.max_queued_requests} queued",
        "minutes": round(elapsed / 60, 2),
        "rate_per_s": args.rate,
        "calls": len(outcomes),
        "by_code": dict(by_code.most_common()),
        "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
        "server_codes": server_codes,
        "client_busy_skips": traffic.skipped,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "server_ttft_p99_ms": _ms(percentile(server_ttfts, 99)),
        "tokens_generated": server_tokens if server_tokens is not None else sum(o.tokens for o in outcomes),
        "cancel_storm": storm,
        "start": start_status,
        "end": end_status,
        "bad": {code: by_code.get(code, 0) + server_codes.get(code, 0) for code in BAD_CODES},
        "server_alive": server is None or server.proc.poll() is None,
    }


def _cancel_storm(traffic: Traffic, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    """Streams cancelled right after their first chunk, one after another; threads before and after."""
    if args.cancel_storm <= 0:
        return {}
    time.sleep(2)
    before = process_status(pid).get("threads") if pid else None
    started = time.monotonic()
    cancelled = 0
    for _ in range(args.cancel_storm):
        if time.monotonic() - started > args.cancel_storm_seconds:
            break
        call = traffic._stub.Generate(traffic._generation(args.long_tokens), timeout=60)
        try:
            next(call)
        except (grpc.RpcError, StopIteration):
            continue
        call.cancel()
        cancelled += 1
    seconds = time.monotonic() - started
    time.sleep(2)
    after = process_status(pid).get("threads") if pid else None
    print(f"soak: cancel storm: {cancelled} streams in {seconds:.0f} s, threads {before} -> {after}", file=sys.stderr)
    return {"cancelled": cancelled, "seconds": round(seconds, 1), "threads_before": before, "threads_after": after}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def passed(report: dict[str, Any]) -> bool:
    storm = report["cancel_storm"]
    threads_kept = not storm or storm["threads_before"] == storm["threads_after"]
    return report["server_alive"] and not any(report["bad"].values()) and threads_kept


def render_doc(report: dict[str, Any]) -> str:
    s, e = report["start"], report["end"]

    def mib(status: dict[str, int], key: str) -> str:
        return f"{status[key] / 1024:.0f} MiB" if key in status else "n/a"

    rows = [
        ("Date", report["date"]),
        ("Host", report["host"]),
        ("Model / engine / device", f"{report['model']} / {report['engine']} / {report['device']}"),
        ("Admission limit", report["admission"]),
        ("Duration", f"{report['minutes']:g} min at {report['rate_per_s']:g} calls/s"),
        ("Calls", str(report["calls"])),
        ("Calls by status (client)", ", ".join(f"{k} {v}" for k, v in report["by_code"].items())),
        ("UNKNOWN / INTERNAL", f"{report['bad']['UNKNOWN']} / {report['bad']['INTERNAL']}"),
        ("Tokens generated", str(report["tokens_generated"])),
        ("TTFT p50 / p99 (client, queueing included)", f"{report['ttft_p50_ms']} ms / {report['ttft_p99_ms']} ms"),
        ("TTFT p99 (server, finished calls)", f"{report['server_ttft_p99_ms']} ms"),
        ("Server RSS start → end (peak)", f"{mib(s, 'rss_kib')} → {mib(e, 'rss_kib')} ({mib(e, 'peak_rss_kib')})"),
        ("Server threads start → end", f"{s.get('threads', 'n/a')} → {e.get('threads', 'n/a')}"),
        (
            "Cancel storm (after the mix)",
            "{cancelled} streams cancelled after their first chunk in {seconds} s; threads {threads_before} → {threads_after}".format(
                **report["cancel_storm"]
            )
            if report["cancel_storm"]
            else "not run",
        ),
        ("Result", "pass" if passed(report) else "FAIL"),
    ]
    kinds = "\n".join(
        f"| {kind} | {', '.join(f'{c} {n}' for c, n in codes.items())} |" for kind, codes in report["by_kind"].items()
    )
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"""# Reliability

`make soak` (`python -m benchmarks.soak`) starts a server on 127.0.0.1 and sends it
minutes of mixed traffic from one process at a bounded rate: short and long generations,
about 20% cancelled mid-stream by the client, 10% malformed requests, 5% with a deadline
too short to finish, and regular bursts past the admission limit (active + queued), which
the server must refuse with RESOURCE_EXHAUSTED before the first message. Then a cancel
storm: 1,000 streams, one after another, each cancelled right after its first chunk. It
passes when no call ends UNKNOWN or INTERNAL, the server is still alive, and the storm left
the server's thread count where it was; resident memory and threads at the start and the
end show whether anything leaks.

The behaviours behind these figures are tested one by one in `tests/production/`
(backpressure, deadlines, cancellation, drain, faults, bad input, security, observability,
and a property test of 2,000 random requests).

## Latest run

| Figure | Value |
| --- | --- |
{table}

### Calls by kind and status

| Kind | Statuses |
| --- | --- |
{kinds}

Expected statuses: malformed → INVALID_ARGUMENT; cancelled → CANCELLED (the client's own
cancel); short-deadline → DEADLINE_EXCEEDED (or OK when it finishes in time); burst →
OK or RESOURCE_EXHAUSTED. Reproduce with `make soak SOAK_ARGS="--minutes 10 --write-doc"`.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="Minutes of mixed traffic against one tokenwire server; reports statuses, memory, threads, TTFT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="default", help="model of the server this starts")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for that server (repeatable)")
    parser.add_argument("--target", default="", help="host:port of a running server instead (loopback only)")
    parser.add_argument("--pid", type=int, default=0, help="with --target: the server's pid, for memory and threads")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to send traffic")
    parser.add_argument("--rate", type=float, default=1.5, help="calls started per second")
    parser.add_argument("--concurrency", type=int, default=48, help="most calls this client runs at once")
    parser.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts past admission")
    parser.add_argument("--burst-tokens", type=int, default=4, help="max_new_tokens of each call of a burst")
    parser.add_argument("--short-tokens", type=int, default=16, help="max_new_tokens of short generations")
    parser.add_argument("--long-tokens", type=int, default=64, help="max_new_tokens of long generations")
    parser.add_argument("--cancel-storm", type=int, default=1000, help="streams cancelled one by one after the mix")
    parser.add_argument("--cancel-storm-seconds", type=float, default=300, help="time bound of the cancel storm")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic mix")
    parser.add_argument("--write-doc", action="store_true", help="write the figures into --doc")
    parser.add_argument("--doc", default="docs/reliability.md", help="where --write-doc writes")
    parser.add_argument("--json", default="", help="also write the raw report as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    host = args.target.rsplit(":", 1)[0] if args.target else "127.0.0.1"
    if host not in ("127.0.0.1", "localhost", "[::1]") and not host.startswith("127."):
        print("soak: --target must be a loopback address", file=sys.stderr)
        return 2
    if args.minutes <= 0 or args.rate <= 0 or args.concurrency < 1:
        print("soak: --minutes, --rate and --concurrency must be positive", file=sys.stderr)
        return 2
    report = soak(args)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.write_doc:
        Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
        Path(args.doc).write_text(render_doc(report))
        print(f"soak: wrote {args.doc}", file=sys.stderr)
    if not passed(report):
        print(f"soak: FAIL: {report['bad']} alive={report['server_alive']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
