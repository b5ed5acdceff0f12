"""`make soak`: minutes of mixed traffic against one server, then its figures.

Starts a server on 127.0.0.1 (the default model unless ``--model``), or targets a running
one (``--target``, with ``--pid`` for its memory and threads). The server it starts has
tenants (``--tenants``, on by default): ``interactive`` (weight 3), ``batch`` (weight 1, at
most normal priority) and ``metered`` (a small token quota), each with its own bearer
token, and every call carries one. From this one process it sends a bounded rate of mixed
calls: short and long generations at random priorities, about 15% cancelled mid-stream,
15% structured (a JSON schema, any JSON object, a regex or a choice; an answer that ends
EOS is checked against its format), 8% cut after a few chunks and resumed
(``GenerateRequest.resume`` with the token ids received; the resumed stream must go on at
the next chunk index), 8% malformed, a few with a deadline too short to finish, and with
tenants a few with a wrong token, a priority above the tenant's cap, or on the metered
tenant's quota; every kind is sent once first, so even a short run has them all. Every
``--burst-every`` seconds a burst past the admission limit (active + queued); after the
mix, a cancel storm (``--cancel-storm`` streams cancelled after their first chunk). Then it
reports the calls by status, by kind and by tenant, checks that none ended UNKNOWN or
INTERNAL and that no structured answer or resumed stream broke its contract, compares the
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
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from tokenwire.bench import percentile
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

from benchmarks.launcher import ServerProcess, process_status
from benchmarks.structured import CHOICES, QUESTIONS, REGEX, SCHEMAS, follows

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
    pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(json_schema="{not json")),
    pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(regex="(unclosed")),
    pb.GenerateRequest(prompt="hi", resume=pb.Resume(generated_token_ids=[2**31], next_index=1)),
)
# The formats of the structured calls: (what it is, the format, a question that asks for it).
# A "json_object" answer must parse as an object; the others as benchmarks.structured checks them.
FORMATS = (
    ("short", pb.ResponseFormat(json_schema=json.dumps(SCHEMAS["short"])), QUESTIONS["short"][0]),
    ("json_object", pb.ResponseFormat(json_object=True), "Describe a cat as a JSON object."),
    ("regex", pb.ResponseFormat(regex=REGEX), "Where and when were you born? City, Country Year."),
    (
        "choice",
        pb.ResponseFormat(choice=pb.Choice(options=CHOICES)),
        "Is this review positive? 'It broke after two days.'",
    ),
)
BAD_CODES = ("UNKNOWN", "INTERNAL")

# The tenants of the server the soak starts (--tenants): who sends the ordinary calls, by
# weight, and a third on a small quota that only the "metered" calls use.
TENANTS_TOML = """
[tenants.interactive]
weight = 3

[tenants.batch]
weight = 1
max_priority = "normal"

[tenants.metered]
weight = 1
tokens_per_minute = 60
"""
SENDERS = (("interactive", 3), ("batch", 1))
PRIORITIES = {  # the priorities each sender's ordinary calls ask for, by weight
    "interactive": ((pb.PRIORITY_HIGH, 1), (pb.PRIORITY_UNSPECIFIED, 3), (pb.PRIORITY_LOW, 1)),
    "batch": ((pb.PRIORITY_UNSPECIFIED, 1), (pb.PRIORITY_LOW, 2)),
}
NO_TENANT = "-"  # a call to a server without tenants

# The mix: each kind's share of the calls; what is left is "short". The tenant kinds are
# sent only to a server with tenants. Every kind goes once first, then they are drawn.
MIX = (
    ("malformed", 0.08),
    ("cancelled", 0.15),
    ("short-deadline", 0.04),
    ("long", 0.10),
    ("structured", 0.15),
    ("resume", 0.08),
)
TENANT_MIX = (("unauthenticated", 0.03), ("priority-above-cap", 0.03), ("metered", 0.04))


@dataclasses.dataclass
class Outcome:
    kind: str
    code: str
    ttft_s: float | None = None
    tokens: int = 0
    tenant: str = NO_TENANT


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the mix: its kind, request, deadline and who sends it."""

    kind: str
    request: pb.GenerateRequest
    timeout: float
    tenant: str = NO_TENANT
    metadata: tuple[tuple[str, str], ...] = ()
    detail: str = ""  # the structured call's format


def write_tenants(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The tenants config and token file of the server the soak starts, in ``folder``: its
    extra flags, and each tenant's token."""
    tokens = {name: f"soak-{name}-{secrets.token_hex(8)}" for name in ("interactive", "batch", "metered")}
    (folder / "tenants.toml").write_text(TENANTS_TOML)
    (folder / "tokens").write_text("".join(f"{token} {name}\n" for name, token in tokens.items()))
    return ["--tenant-config", str(folder / "tenants.toml"), "--auth-token-file", str(folder / "tokens")], tokens


class Traffic:
    """Sends the mix and records what came back; thread-safe."""

    def __init__(
        self,
        stub: pb_grpc.TextGenerationStub,
        args: argparse.Namespace,
        rng: random.Random,
        tokens: dict[str, str] | None = None,
    ) -> None:
        self._stub = stub
        self._args = args
        self._rng = rng
        self._tokens = tokens or {}
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.violations: list[str] = []  # structured answers or resumed streams that broke their contract
        self.skipped = 0
        self.kinds = [kind for kind, _ in MIX] + ([kind for kind, _ in TENANT_MIX] if self._tokens else []) + ["short"]
        self._first_round = list(self.kinds)

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def _failed(
        self, kind: str, error: grpc.RpcError, ttft: float | None, tenant: str, request: pb.GenerateRequest
    ) -> None:
        """A call that ended with ``error``; one that ended UNKNOWN or INTERNAL is also listed with
        its message and request, so that a failed soak says what to reproduce."""
        code = error.code().name
        self._record(Outcome(kind, code, ttft, tenant=tenant))
        if code in BAD_CODES:
            shown = str(request).replace("\n", " ")[:600]
            self._violation(f"{kind}: {code} {error.details()!r} for {shown}")

    def _violation(self, what: str) -> None:
        with self._lock:
            self.violations.append(what)

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._tokens[tenant]}"),) if tenant in self._tokens else ()

    def sender(self) -> str:
        """The tenant of an ordinary call, by weight; NO_TENANT on a server without tenants."""
        if not self._tokens:
            return NO_TENANT
        return self._rng.choices([n for n, _ in SENDERS], [w for _, w in SENDERS])[0]

    def _generation(self, tokens: int, tenant: str = NO_TENANT) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            prompt=self._rng.choice(PROMPTS),
            sampling=pb.SamplingParams(temperature=0.7, seed=self._rng.randrange(2**32)),
            stopping=pb.StoppingCriteria(max_new_tokens=tokens),
        )
        if tenant in PRIORITIES:
            choices = PRIORITIES[tenant]
            request.priority = self._rng.choices([p for p, _ in choices], [w for _, w in choices])[0]
        return request

    def _kind(self) -> str:
        if self._first_round:
            return self._first_round.pop(0)
        roll = self._rng.random()
        for kind, share in MIX + (TENANT_MIX if self._tokens else ()):
            if roll < share:
                return kind
            roll -= share
        return "short"

    def pick(self) -> Call:
        """The next call of the mix."""
        kind = self._kind()
        a = self._args
        tenant = self.sender()
        if kind == "malformed":
            return Call(kind, self._rng.choice(MALFORMED), 10.0, tenant, self.auth(tenant))
        if kind in ("cancelled", "long", "resume"):
            return Call(kind, self._generation(a.long_tokens, tenant), 120.0, tenant, self.auth(tenant))
        if kind == "short-deadline":
            return Call(kind, self._generation(a.long_tokens, tenant), 0.2, tenant, self.auth(tenant))
        if kind == "structured":
            name, fmt, question = self._rng.choice(FORMATS)
            request = pb.GenerateRequest(
                chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]),
                sampling=pb.SamplingParams(temperature=0.7, seed=self._rng.randrange(2**32)),
                stopping=pb.StoppingCriteria(max_new_tokens=a.long_tokens),
                response_format=fmt,
            )
            return Call(kind, request, 120.0, tenant, self.auth(tenant), detail=name)
        if kind == "unauthenticated":
            return Call(
                kind, self._generation(a.short_tokens), 10.0, "wrong-token", (("authorization", "Bearer not-a-token"),)
            )
        if kind == "priority-above-cap":  # batch may ask for normal priority at most
            request = self._generation(a.short_tokens)
            request.priority = pb.PRIORITY_HIGH
            return Call(kind, request, 10.0, "batch", self.auth("batch"))
        if kind == "metered":
            return Call(kind, self._generation(a.short_tokens), 60.0, "metered", self.auth("metered"))
        return Call("short", self._generation(a.short_tokens, tenant), 60.0, tenant, self.auth(tenant))

    def run(self, call: Call) -> None:
        try:
            if call.kind == "resume":
                self.resume(call)
            else:
                self.run_one(call)
        except Exception as exc:  # a bug here would vanish in the pool's future: count it
            self._violation(f"{call.kind}: the soak's own client failed: {exc!r}")

    def run_one(self, call: Call) -> None:
        started = time.monotonic()
        ttft = None
        tokens = 0
        chunks: list[pb.TokenChunk] = []
        cancel_after = self._rng.randint(1, 6) if call.kind == "cancelled" else None
        stream = self._stub.Generate(call.request, timeout=call.timeout, metadata=call.metadata)
        try:
            for count, chunk in enumerate(stream, 1):
                if ttft is None:
                    ttft = time.monotonic() - started
                chunks.append(chunk)
                if chunk.HasField("usage"):
                    tokens = chunk.usage.completion_tokens
                if cancel_after is not None and count >= cancel_after:
                    stream.cancel()
                    self._record(Outcome(call.kind, "CANCELLED", ttft, tenant=call.tenant))
                    return
            self._record(Outcome(call.kind, "OK", ttft, tokens, call.tenant))
        except grpc.RpcError as error:
            self._failed(call.kind, error, ttft, call.tenant, call.request)
            return
        if call.kind == "structured":
            self._check_format(call.detail, chunks)

    def _check_format(self, name: str, chunks: list[pb.TokenChunk]) -> None:
        """An answer that ended EOS is whole: it must follow its format (one cut by
        max_new_tokens is only a prefix)."""
        if not chunks or chunks[-1].finish_reason != pb.FINISH_REASON_EOS:
            return
        text = "".join(c.text for c in chunks)
        if name == "json_object":
            try:
                ok = isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
        else:
            ok = follows(name, text)
        if not ok:
            self._violation(f"structured {name}: the answer {text[:200]!r} does not follow its format")

    def resume(self, call: Call) -> None:
        """Cut a stream after a few chunks, then resume it with the token ids received: the
        rest must go on at the next chunk index, with usage counting the whole answer."""
        cut = self._rng.randint(1, 6)
        request = pb.GenerateRequest()
        request.CopyFrom(call.request)
        request.output.token_ids = True  # one chunk per token, with its id
        started = time.monotonic()
        ttft = None
        received: list[pb.TokenChunk] = []
        stream = self._stub.Generate(request, timeout=call.timeout, metadata=call.metadata)
        try:
            for chunk in stream:
                if ttft is None:
                    ttft = time.monotonic() - started
                received.append(chunk)
                if len(received) >= cut:
                    stream.cancel()
                    break
        except grpc.RpcError as error:
            self._failed("resume-cut", error, ttft, call.tenant, call.request)
            return
        if not received or received[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED:  # it ended before the cut
            self._record(
                Outcome("resume-cut", "OK", ttft, received[-1].usage.completion_tokens if received else 0, call.tenant)
            )
            return
        self._record(Outcome("resume-cut", "CANCELLED", ttft, tenant=call.tenant))
        ids = [t.id for c in received for t in c.tokens]
        request.resume.generated_token_ids.extend(ids)
        request.resume.next_index = len(received)
        if received[0].HasField("seed"):
            request.sampling.seed = received[0].seed
        started = time.monotonic()
        ttft = None
        rest: list[pb.TokenChunk] = []
        try:
            for chunk in self._stub.Generate(request, timeout=call.timeout, metadata=call.metadata):
                if ttft is None:
                    ttft = time.monotonic() - started
                rest.append(chunk)
        except grpc.RpcError as error:
            self._failed("resume", error, ttft, call.tenant, request)
            return
        if not rest:
            self._violation(f"resume after {len(received)} chunks: an OK stream of no chunks")
            return
        self._record(Outcome("resume", "OK", ttft, rest[-1].usage.completion_tokens - len(ids), call.tenant))
        indexes = [c.index for c in rest]
        if indexes != list(range(len(received), len(received) + len(rest))):
            self._violation(f"resume after {len(received)} chunks: the resumed stream's indexes are {indexes[:8]}")
        total = len(ids) + sum(len(c.tokens) for c in rest)
        if rest[-1].usage.completion_tokens != total:
            self._violation(
                f"resume after {len(ids)} tokens: usage says {rest[-1].usage.completion_tokens} tokens, the streams {total}"
            )

    def burst(self, size: int) -> None:
        """Start ``size`` calls at once (past admission), then read them all."""
        started = []
        for _ in range(size):
            tenant = self.sender()
            stream = self._stub.Generate(
                self._generation(self._args.burst_tokens, tenant), timeout=120, metadata=self.auth(tenant)
            )
            started.append((tenant, stream))
        for tenant, stream in started:
            try:
                chunks = list(stream)
                self._record(Outcome("burst", "OK", None, chunks[-1].usage.completion_tokens if chunks else 0, tenant))
            except grpc.RpcError as error:
                self._record(Outcome("burst", error.code().name, tenant=tenant))


def soak(args: argparse.Namespace) -> dict[str, Any]:
    server: ServerProcess | None = None
    tokens: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as folder:
        if args.target:
            target, pid = args.target, args.pid
        else:
            server_args = ["--model", args.model, *args.server_arg]
            if args.tenants:
                flags, tokens = write_tenants(Path(folder))
                server_args += flags
            print(f"soak: starting tokenwire-server {' '.join(server_args)}", file=sys.stderr, flush=True)
            server = ServerProcess(server_args, ready_timeout=600)
            target, pid = server.target, server.proc.pid
        try:
            return _drive(args, target, pid, server, tokens)
        finally:
            if server is not None:
                server.terminate(timeout=120)
                server.kill()


def _drive(
    args: argparse.Namespace, target: str, pid: int | None, server: ServerProcess | None, tokens: dict[str, str]
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.TextGenerationStub(channel)
    traffic = Traffic(stub, args, rng, tokens)
    auth = traffic.auth("interactive")
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=auth)
    admission = info.max_active_streams + info.max_queued_requests
    burst_size = admission + max(8, admission // 4)
    # A few calls first so lazily grown pools are at their working size before the start figures
    # (and each structured format compiled once).
    tokenize = [
        stub.Tokenize.future(pb.TokenizeRequest(text="warm up " * 200), timeout=120, metadata=auth) for _ in range(8)
    ]
    for future in tokenize:
        future.result()
    for _ in range(4):
        traffic.run_one(Call("warm-up", traffic._generation(args.short_tokens), 120, metadata=auth))
    for name, fmt, question in FORMATS:
        request = pb.GenerateRequest(
            prompt=question, stopping=pb.StoppingCriteria(max_new_tokens=2), response_format=fmt
        )
        traffic.run_one(Call("warm-up", request, 120, metadata=auth, detail=name))
    traffic.outcomes.clear()
    warm_lines = len(server.find("request finished")) if server is not None else 0
    start_status = process_status(pid) if pid else {}
    print(
        f"soak: {args.minutes:g} min at {args.rate:g} calls/s against {target} "
        f"({info.name}, {info.engine}, admission {info.max_active_streams}+{info.max_queued_requests}, "
        f"bursts of {burst_size} every {args.burst_every:g} s, tenants {sorted(tokens) or 'off'})",
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
                pending.add(pool.submit(traffic.run, traffic.pick()))
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
    server_errors: list[dict[str, Any]] = []
    if server is not None:
        finished = server.find("request finished")[warm_lines:]
        server_codes = dict(collections.Counter(r.get("code", "?") for r in finished))
        server_tokens = sum(int(r.get("completion_tokens", 0)) for r in finished)
        server_ttfts = [r["ttft_ms"] / 1000 for r in finished if r.get("code") == "OK" and "ttft_ms" in r]
        # What a call that ended INTERNAL logged (its traceback), so that a failed soak says why.
        server_errors = [
            {"msg": r.get("msg"), "request_id": r.get("request_id"), "exception": str(r.get("exception", ""))[-2000:]}
            for r in server.records
            if r.get("level") == "error"
        ][:10]
    channel.close()
    outcomes = list(traffic.outcomes)
    by_code = collections.Counter(o.code for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.code in ("OK", "CANCELLED")]
    return {
        "date": datetime.date.today().isoformat(),
        "host": f"{platform.machine()}, {_cpus()} CPUs",
        "model": info.name,
        "engine": info.engine,
        "device": info.device,
        "admission": f"{info.max_active_streams} active + {info.max_queued_requests} queued",
        "tenants": sorted(tokens),
        "minutes": round(elapsed / 60, 2),
        "rate_per_s": args.rate,
        "calls": len(outcomes),
        "by_code": dict(by_code.most_common()),
        "by_kind": _tally(outcomes, lambda o: o.kind),
        "by_tenant": _tally(outcomes, lambda o: o.tenant),
        "server_codes": server_codes,
        "server_errors": server_errors,
        "client_busy_skips": traffic.skipped,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "server_ttft_p99_ms": _ms(percentile(server_ttfts, 99)),
        "tokens_generated": server_tokens if server_tokens is not None else sum(o.tokens for o in outcomes),
        "cancel_storm": storm,
        "start": start_status,
        "end": end_status,
        "bad": {code: by_code.get(code, 0) + server_codes.get(code, 0) for code in BAD_CODES},
        "violations": list(traffic.violations),
        "server_alive": server is None or server.proc.poll() is None,
    }


def _tally(outcomes: Sequence[Outcome], key: Any) -> dict[str, dict[str, int]]:
    """Statuses counted under each ``key(outcome)``, sorted."""
    out: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (name, code), count in collections.Counter((key(o), o.code) for o in outcomes).items():
        out[name][code] = count
    return {name: dict(sorted(codes.items())) for name, codes in sorted(out.items())}


def _cancel_storm(traffic: Traffic, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    """Streams cancelled right after their first chunk, one after another; threads before and after."""
    if args.cancel_storm <= 0:
        return {}
    time.sleep(2)
    before = process_status(pid).get("threads") if pid else None
    started = time.monotonic()
    cancelled = 0
    auth = traffic.auth("interactive")
    for _ in range(args.cancel_storm):
        if time.monotonic() - started > args.cancel_storm_seconds:
            break
        call = traffic._stub.Generate(traffic._generation(args.long_tokens), timeout=60, metadata=auth)
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
    return report["server_alive"] and not any(report["bad"].values()) and threads_kept and not report["violations"]


def render_doc(report: dict[str, Any]) -> str:
    s, e = report["start"], report["end"]

    def mib(status: dict[str, int], key: str) -> str:
        return f"{status[key] / 1024:.0f} MiB" if key in status else "n/a"

    rows = [
        ("Date", report["date"]),
        ("Host", report["host"]),
        ("Model / engine / device", f"{report['model']} / {report['engine']} / {report['device']}"),
        ("Admission limit", report["admission"]),
        ("Tenants", ", ".join(report["tenants"]) or "none"),
        ("Duration", f"{report['minutes']:g} min at {report['rate_per_s']:g} calls/s"),
        ("Calls", str(report["calls"])),
        ("Calls by status (client)", ", ".join(f"{k} {v}" for k, v in report["by_code"].items())),
        ("UNKNOWN / INTERNAL", f"{report['bad']['UNKNOWN']} / {report['bad']['INTERNAL']}"),
        ("Broken contracts (structured answers, resumed streams)", str(len(report["violations"]))),
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

    def statuses(tally: dict[str, dict[str, int]]) -> str:
        return "\n".join(
            f"| {name} | {', '.join(f'{c} {n}' for c, n in codes.items())} |" for name, codes in tally.items()
        )

    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return f"""# Reliability

`make soak` (`python -m benchmarks.soak`) starts a server on 127.0.0.1 with three tenants
(`interactive` weight 3, `batch` weight 1 at most normal priority, `metered` on a quota of
60 tokens a minute), each with its bearer token, and sends it minutes of mixed traffic from
one process at a bounded rate: short and long generations at random priorities, about 15%
cancelled mid-stream by the client, 15% structured (JSON schema, JSON object, regex or
choice; each answer that ends EOS is checked against its format), 8% cut after a few chunks
and resumed with the token ids received (the resumed stream must go on at the next chunk
index, its usage counting the whole answer), 8% malformed requests, 4% with a deadline too
short to finish, 3% with a wrong token, 3% asking for a priority above the tenant's cap, 4%
on the metered tenant's quota, and regular bursts past the admission limit (active +
queued), which the server must refuse with RESOURCE_EXHAUSTED before the first message.
Then a cancel storm: 1,000 streams, one after another, each cancelled right after its first
chunk. It passes when no call ends UNKNOWN or INTERNAL, no structured answer or resumed
stream breaks its contract, the server is still alive, and the storm left the server's
thread count where it was; resident memory and threads at the start and the end show
whether anything leaks.

The behaviours behind these figures are tested one by one in `tests/production/`
(backpressure, deadlines, cancellation, drain, faults, bad input, security, tenants,
observability, a property test of 2,000 random requests, and a fuzz test of raw and
mutated request bytes and hostile field values).

## Latest run

| Figure | Value |
| --- | --- |
{table}

### Calls by kind and status

| Kind | Statuses |
| --- | --- |
{statuses(report["by_kind"])}

### Calls by tenant and status

| Tenant | Statuses |
| --- | --- |
{statuses(report["by_tenant"])}

Expected statuses: malformed → INVALID_ARGUMENT; cancelled and resume-cut → CANCELLED (the
client's own cancel; OK when the stream ended before the cut); resume → OK; structured → OK;
short-deadline → DEADLINE_EXCEEDED (or OK when it finishes in time); burst → OK or
RESOURCE_EXHAUSTED; unauthenticated → UNAUTHENTICATED; priority-above-cap →
INVALID_ARGUMENT; metered → OK or RESOURCE_EXHAUSTED (its quota). Reproduce with
`make soak SOAK_ARGS="--minutes 10 --write-doc"`.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description="Minutes of mixed traffic against one tokenwire server; reports statuses, memory, threads, TTFT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="default", help="model of the server this starts")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for that server (repeatable)")
    parser.add_argument(
        "--target", default="", help="host:port of a running server instead (loopback only; no tenants)"
    )
    parser.add_argument("--pid", type=int, default=0, help="with --target: the server's pid, for memory and threads")
    parser.add_argument(
        "--tenants", action=argparse.BooleanOptionalAction, default=True,
        help="start the server with three tenants and bearer tokens, and mix in the tenants' kinds of call",
    )  # fmt: skip
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to send traffic")
    parser.add_argument("--rate", type=float, default=1.5, help="calls started per second")
    parser.add_argument("--concurrency", type=int, default=48, help="most calls this client runs at once")
    parser.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts past admission")
    parser.add_argument("--burst-tokens", type=int, default=4, help="max_new_tokens of each call of a burst")
    parser.add_argument("--short-tokens", type=int, default=16, help="max_new_tokens of short generations")
    parser.add_argument(
        "--long-tokens", type=int, default=64, help="max_new_tokens of long, structured and resumed generations"
    )
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
        print(
            f"soak: FAIL: {report['bad']} violations={report['violations'][:5]} alive={report['server_alive']}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
