"""Minutes of mixed traffic against one server, then its figures (`make soak`).

The mix (``MIX``, ``TENANT_MIX``), bursts past admission and a cancel storm; what it checks and what passes:
docs/reliability.md, whose "soak" section ``--write-doc`` replaces. Exits 1 when the run fails.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import dataclasses
import datetime
import json
import os
import platform
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from tokenwire.v1 import generation_pb2 as pb

from benchmarks import doc, load
from benchmarks.launcher import process_status, serve, tenant_flags
from benchmarks.stats import ms
from benchmarks.structured import CHOICES, QUESTIONS, REGEX, SCHEMAS, follows

OUT = None  # --write-doc: docs/reliability.md (--doc)
HEADER = "# Reliability\n"
FLAGS = {
    "server_arg": ([], "extra flag for the server this starts (repeatable)"),
    "tenants": (True, "start the server with three tenants and bearer tokens, and mix in the tenants' kinds of call"),
    "minutes": (10.0, "how long to send traffic"), "rate": (1.5, "calls started per second"),
    "concurrency": (48, "most calls this client runs at once"),
    "burst_every": (60.0, "seconds between bursts past admission"),
    "burst_tokens": (4, "max_new_tokens of each call of a burst"),
    "short_tokens": (16, "max_new_tokens of short generations"),
    "long_tokens": (64, "max_new_tokens of long, structured and resumed generations"),
    "cancel_storm": (1000, "streams cancelled one by one after the mix"),
    "cancel_storm_seconds": (300.0, "time bound of the cancel storm"), "seed": (0, "seed of the traffic mix"),
    "write_doc": (False, "write the figures into --doc"), "doc": ("docs/reliability.md", "where --write-doc writes"),
    "json": ("", "also write the raw report as JSON here"),
}  # fmt: skip
DRY_RUN = {"minutes": 0.05, "rate": 10.0, "concurrency": 8, "burst_every": 1.0, "short_tokens": 2, "long_tokens": 4,
           "burst_tokens": 2, "cancel_storm": 3, "cancel_storm_seconds": 5.0}  # fmt: skip
PROMPTS = ("Write a haiku about the sea.", "Explain what a hash table is in two sentences.",
           "List three uses of copper.", "Translate 'good morning' into French, German and Spanish.",
           "What is the capital of Japan? Answer briefly.",
           "Tell me a short story about a robot who learns to paint.")  # fmt: skip
MALFORMED = (
    pb.GenerateRequest(), pb.GenerateRequest(prompt=""),
    pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0)),
    pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(max_new_tokens=0)),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(max_new_tokens=2**32 - 1)),
    pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(stop_sequences=[""])),
    pb.GenerateRequest(prompt="hi", output=pb.OutputOptions(top_logprobs=99)),
    pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**31])), pb.GenerateRequest(prompt="nul \x00 inside"),
    pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(json_schema="{not json")),
    pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(regex="(unclosed")),
    pb.GenerateRequest(prompt="hi", resume=pb.Resume(generated_token_ids=[2**31], next_index=1)),
)  # fmt: skip
# The formats of the structured calls: (what it is, the format, a question that asks for it).
# An answer must follow its format as benchmarks.structured.follows checks it ("json_object": any object).
FORMATS = (
    ("short", pb.ResponseFormat(json_schema=json.dumps(SCHEMAS["short"])), QUESTIONS["short"][0]),
    ("json_object", pb.ResponseFormat(json_object=True), "Describe a cat as a JSON object."),
    ("regex", pb.ResponseFormat(regex=REGEX), "Where and when were you born? City, Country Year."),
    ("choice", pb.ResponseFormat(choice=pb.Choice(options=CHOICES)),
     "Is this review positive? 'It broke after two days.'"),
)  # fmt: skip
BAD_CODES = ("UNKNOWN", "INTERNAL")
# The tenants of the server the soak starts (--tenants): who sends the ordinary calls, by
# weight, and a third on a small quota that only the "metered" calls use.
TENANTS_TOML = """[tenants.interactive]\nweight = 3\n[tenants.batch]\nweight = 1\nmax_priority = "normal"
[tenants.metered]\nweight = 1\ntokens_per_minute = 60\n"""
SENDERS = (("interactive", 3), ("batch", 1))
PRIORITIES = {  # the priorities each sender's ordinary calls ask for, by weight
    "interactive": ((pb.PRIORITY_HIGH, 1), (pb.PRIORITY_UNSPECIFIED, 3), (pb.PRIORITY_LOW, 1)),
    "batch": ((pb.PRIORITY_UNSPECIFIED, 1), (pb.PRIORITY_LOW, 2)),
}
NO_TENANT = "-"  # a call to a server without tenants
# The mix: each kind's share of the calls; what is left is "short". The tenant kinds are
# sent only to a server with tenants. Every kind goes once first, then they are drawn.
MIX = (("malformed", 0.08), ("cancelled", 0.15), ("short-deadline", 0.04), ("long", 0.10), ("structured", 0.15),
       ("resume", 0.08))  # fmt: skip
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


def _pick(rng: random.Random, weighted: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([value for value, _ in weighted], [weight for _, weight in weighted])[0]


class Traffic:
    """Sends the mix and records what came back; thread-safe (its lists only grow by ``append``)."""

    def __init__(
        self, stub: Any, args: argparse.Namespace, rng: random.Random, tokens: dict[str, str] | None = None
    ) -> None:
        self._stub, self._args, self._rng, self._tokens = stub, args, rng, tokens or {}
        self.outcomes: list[Outcome] = []
        self.violations: list[str] = []  # structured answers or resumed streams that broke their contract
        self.skipped = 0
        self._mix = MIX + (TENANT_MIX if self._tokens else ())
        self.kinds = [kind for kind, _ in self._mix] + ["short"]
        self._first_round = list(self.kinds)

    def _failed(self, kind: str, stream: load.Stream, tenant: str, request: Any) -> bool:
        """Whether ``stream`` ended with an error, recorded; UNKNOWN and INTERNAL with what to reproduce."""
        if stream.error is None:
            return False
        code = stream.error.code().name
        self.outcomes.append(Outcome(kind, code, stream.ttft, tenant=tenant))
        if code in BAD_CODES:
            shown = str(request).replace("\n", " ")[:600]
            self.violations.append(f"{kind}: {code} {stream.error.details()!r} for {shown}")
        return True

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return load.bearer(self._tokens[tenant]) if tenant in self._tokens else ()

    def sender(self) -> str:
        """The tenant of an ordinary call, by weight; NO_TENANT on a server without tenants."""
        return _pick(self._rng, SENDERS) if self._tokens else NO_TENANT

    def _generation(self, tokens: int, tenant: str = NO_TENANT, text: str = "", **fields: Any) -> pb.GenerateRequest:
        """A sampled request for ``tokens``: a prompt of ``PROMPTS`` (or ``text``, as a chat), at a priority
        ``tenant`` may ask for."""
        text, chat = text or self._rng.choice(PROMPTS), bool(text)
        sampling = {"temperature": 0.7, "seed": self._rng.randrange(2**32)}
        request = load.request(text, tokens, chat=chat, sampling=sampling, **fields)
        if tenant in PRIORITIES:
            request.priority = _pick(self._rng, PRIORITIES[tenant])
        return request

    def _kind(self) -> str:
        if self._first_round:
            return self._first_round.pop(0)
        return _pick(self._rng, [*self._mix, ("short", 1 - sum(share for _, share in self._mix))])

    def pick(self) -> Call:
        """The next call of the mix."""
        kind, a, tenant = self._kind(), self._args, self.sender()
        auth = self.auth(tenant)
        if kind == "malformed":
            return Call(kind, self._rng.choice(MALFORMED), 10.0, tenant, auth)
        if kind in ("cancelled", "long", "resume", "short-deadline"):
            timeout = 0.2 if kind == "short-deadline" else 120.0
            return Call(kind, self._generation(a.long_tokens, tenant), timeout, tenant, auth)
        if kind == "structured":
            name, fmt, question = self._rng.choice(FORMATS)
            request = self._generation(a.long_tokens, text=question, response_format=fmt)
            return Call(kind, request, 120.0, tenant, auth, detail=name)
        if kind == "unauthenticated":
            wrong = (("authorization", "Bearer not-a-token"),)
            return Call(kind, self._generation(a.short_tokens), 10.0, "wrong-token", wrong)
        if kind == "priority-above-cap":  # batch may ask for normal priority at most
            request = self._generation(a.short_tokens, priority=pb.PRIORITY_HIGH)
            return Call(kind, request, 10.0, "batch", self.auth("batch"))
        if kind == "metered":
            return Call(kind, self._generation(a.short_tokens), 60.0, "metered", self.auth("metered"))
        return Call("short", self._generation(a.short_tokens, tenant), 60.0, tenant, auth)

    def run(self, call: Call) -> None:
        try:
            self.resume(call) if call.kind == "resume" else self.run_one(call)
        except Exception as exc:  # a bug here would vanish in the pool's future: count it
            self.violations.append(f"{call.kind}: the soak's own client failed: {exc!r}")

    def _read(self, call: Call, request: Any, cut: int = 0) -> load.Stream:
        """``request`` sent as ``call``, cancelled after ``cut`` chunks; its error kept."""
        return load.stream(self._stub, request, call.timeout, call.metadata, cut, catch=True)

    def run_one(self, call: Call) -> None:
        cut = self._rng.randint(1, 6) if call.kind == "cancelled" else 0
        got = self._read(call, call.request, cut)
        if self._failed(call.kind, got, call.tenant, call.request):
            return
        if cut and len(got.chunks) == cut:
            return self.outcomes.append(Outcome(call.kind, "CANCELLED", got.ttft, tenant=call.tenant))
        tokens = next((c.usage.completion_tokens for c in reversed(got.chunks) if c.HasField("usage")), 0)
        self.outcomes.append(Outcome(call.kind, "OK", got.ttft, tokens, call.tenant))
        # An answer that ended EOS is whole: it must follow its format (one cut by max_new_tokens is a prefix).
        whole = bool(got.chunks) and got.chunks[-1].finish_reason == pb.FINISH_REASON_EOS
        if call.kind == "structured" and whole and not follows(call.detail, got.text):
            self.violations.append(
                f"structured {call.detail}: the answer {got.text[:200]!r} does not follow its format"
            )

    def resume(self, call: Call) -> None:
        """Cut a stream after a few chunks, then resume it with the token ids received: the
        rest must go on at the next chunk index, with usage counting the whole answer."""
        request = copy.deepcopy(call.request)
        request.output.token_ids = True  # one chunk per token, with its id
        cut = self._read(call, request, self._rng.randint(1, 6))
        if self._failed("resume-cut", cut, call.tenant, call.request):
            return
        received, ids = cut.chunks, cut.ids
        if not received or received[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED:  # it ended before the cut
            tokens = received[-1].usage.completion_tokens if received else 0
            return self.outcomes.append(Outcome("resume-cut", "OK", cut.ttft, tokens, call.tenant))
        self.outcomes.append(Outcome("resume-cut", "CANCELLED", cut.ttft, tenant=call.tenant))
        request = load.resumed(request, received)
        if received[0].HasField("seed"):
            request.sampling.seed = received[0].seed
        rest = self._read(call, request)
        if self._failed("resume", rest, call.tenant, request):
            return
        if not rest.chunks:
            return self.violations.append(f"resume after {len(received)} chunks: an OK stream of no chunks")
        used = rest.usage.completion_tokens
        self.outcomes.append(Outcome("resume", "OK", rest.ttft, used - len(ids), call.tenant))
        indexes = [c.index for c in rest.chunks]
        if indexes != list(range(len(received), len(received) + len(indexes))):
            self.violations.append(
                f"resume after {len(received)} chunks: the resumed stream's indexes are {indexes[:8]}"
            )
        if used != (total := len(ids) + len(rest.ids)):
            self.violations.append(f"resume after {len(ids)} tokens: usage says {used} tokens, the streams {total}")

    def burst(self, size: int) -> None:
        """Start ``size`` calls at once (past admission), then read them all."""
        started = []
        for _ in range(size):
            tenant = self.sender()
            request = self._generation(self._args.burst_tokens, tenant)
            started.append((tenant, self._stub.Generate(request, timeout=120, metadata=self.auth(tenant))))
        for tenant, stream in started:
            try:
                chunks = list(stream)
                tokens = chunks[-1].usage.completion_tokens if chunks else 0
                self.outcomes.append(Outcome("burst", "OK", None, tokens, tenant))
            except grpc.RpcError as error:
                self.outcomes.append(Outcome("burst", error.code().name, tenant=tenant))


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """The run: the report ``render_doc`` writes."""
    tokens = {name: f"soak-{name}-{secrets.token_hex(8)}" for name in ("interactive", "batch", "metered")}
    tokens = tokens if args.tenants else {}
    with tempfile.TemporaryDirectory(prefix="soak-") as folder:
        flags = ["--model", args.model, *args.server_arg]
        if tokens:
            flags += tenant_flags(Path(folder), "".join(f"{t} {n}\n" for n, t in tokens.items()), TENANTS_TOML)
        doc.log(f"soak: starting tokenwire-server {' '.join(flags)}")
        with serve(args.dry_run, flags, ready_timeout=600, stop_timeout=120) as server:
            return _drive(args, server, None if args.dry_run else server.proc.pid, tokens)  # the fake: no process


def _drive(args: argparse.Namespace, server: Any, pid: int | None, tokens: dict[str, str]) -> dict[str, Any]:
    target = server.target
    channel = grpc.insecure_channel(target)
    stub = load.stub(channel)
    traffic = Traffic(stub, args, random.Random(args.seed), tokens)
    auth = traffic.auth("interactive")
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=auth)
    admission = info.max_active_streams + info.max_queued_requests
    burst_size = admission + max(8, admission // 4)
    # A few calls first so lazily grown pools are at their working size before the start figures
    # (and each structured format compiled once).
    tokenize = pb.TokenizeRequest(text="warm up " * 200)
    for future in [stub.Tokenize.future(tokenize, timeout=120, metadata=auth) for _ in range(8)]:
        future.result()
    warm_up = [(traffic._generation(args.short_tokens), "") for _ in range(4)]
    warm_up += [(load.request(question, 2, response_format=fmt), name) for name, fmt, question in FORMATS]
    for request, name in warm_up:
        traffic.run_one(Call("warm-up", request, 120, metadata=auth, detail=name))
    traffic.outcomes.clear()
    warm_lines = len(server.find("request finished"))
    start_status = process_status(pid) if pid else {}
    doc.log(f"soak: {args.minutes:g} min at {args.rate:g} calls/s against {target} "
            f"({info.name}, {info.engine}, admission "
            f"{info.max_active_streams}+{info.max_queued_requests}, "
            f"bursts of {burst_size} every {args.burst_every:g} s, "
            f"tenants {sorted(tokens) or 'off'})")  # fmt: skip
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
                doc.log(f"soak: {now - started:5.0f} s  {dict(codes)}")
            time.sleep(max(0.0, started + sent / args.rate - time.monotonic()))
    finally:
        concurrent.futures.wait(pending, timeout=180)
        pool.shutdown(wait=False, cancel_futures=True)
    elapsed = time.monotonic() - started
    storm = _cancel_storm(traffic, args, pid)
    time.sleep(2)  # let the server retire what was cancelled last
    end_status = process_status(pid) if pid else {}
    finished = server.find("request finished")[warm_lines:]
    server_codes = dict(collections.Counter(r.get("code", "?") for r in finished))
    server_ttfts = [r["ttft_ms"] / 1000 for r in finished if r.get("code") == "OK" and "ttft_ms" in r]
    # What a call that ended INTERNAL logged (its traceback), so that a failed soak says why.
    server_errors = [{"msg": r.get("msg"), "request_id": r.get("request_id"),
                      "exception": str(r.get("exception", ""))[-2000:]}
                     for r in server.records if r.get("level") == "error"][:10]  # fmt: skip
    channel.close()
    outcomes = list(traffic.outcomes)
    by_code = collections.Counter(o.code for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.code in ("OK", "CANCELLED")]
    return {
        "date": datetime.date.today().isoformat(),
        "host": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "model": info.name, "engine": info.engine, "device": info.device,
        "admission": f"{info.max_active_streams} active + {info.max_queued_requests} queued",
        "tenants": sorted(tokens), "minutes": round(elapsed / 60, 2), "rate_per_s": args.rate, "calls": len(outcomes),
        "by_code": dict(by_code.most_common()),
        "by_kind": _tally(outcomes, lambda o: o.kind),
        "by_tenant": _tally(outcomes, lambda o: o.tenant),
        "server_codes": server_codes,
        "server_errors": server_errors,
        "client_busy_skips": traffic.skipped,
        "ttft_p50_ms": ms(ttfts, 50, 1), "ttft_p99_ms": ms(ttfts, 99, 1), "server_ttft_p99_ms": ms(server_ttfts, 99, 1),
        "tokens_generated": sum(int(r.get("completion_tokens", 0)) for r in finished),
        "cancel_storm": storm,
        "start": start_status,
        "end": end_status,
        "bad": {code: by_code.get(code, 0) + server_codes.get(code, 0) for code in BAD_CODES},
        "violations": list(traffic.violations),
        "server_alive": server.proc.poll() is None,
    }  # fmt: skip


def _tally(outcomes: Sequence[Outcome], key: Callable[[Outcome], str]) -> dict[str, dict[str, int]]:
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
    started, cancelled = time.monotonic(), 0
    for _ in range(args.cancel_storm):
        if time.monotonic() - started > args.cancel_storm_seconds:
            break
        call = Call("storm", traffic._generation(args.long_tokens), 60, metadata=traffic.auth("interactive"))
        got = traffic._read(call, call.request, cut=1)
        cancelled += bool(got.chunks) and got.error is None
    seconds = time.monotonic() - started
    time.sleep(2)
    after = process_status(pid).get("threads") if pid else None
    doc.log(f"soak: cancel storm: {cancelled} streams in {seconds:.0f} s, threads {before} -> {after}")
    return {"cancelled": cancelled, "seconds": round(seconds, 1), "threads_before": before, "threads_after": after}


def passed(report: dict[str, Any]) -> bool:
    storm = report["cancel_storm"]
    threads_kept = not storm or storm["threads_before"] == storm["threads_after"]
    return report["server_alive"] and not any(report["bad"].values()) and threads_kept and not report["violations"]


def render_doc(report: dict[str, Any], command: str = "python -m benchmarks soak") -> str:
    """The "soak" section of docs/reliability.md."""
    s, e, storm = report["start"], report["end"], report["cancel_storm"]

    def mib(status: dict[str, int], key: str) -> str:
        return f"{status[key] / 1024:.0f} MiB" if key in status else "n/a"

    def statuses(tally: dict[str, dict[str, int]]) -> list[list[str]]:
        return [[name, ", ".join(f"{c} {n}" for c, n in codes.items())] for name, codes in tally.items()]

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
        ("Cancel storm (after the mix)", "{cancelled} streams cancelled after their first chunk in {seconds} s; "
         "threads {threads_before} → {threads_after}".format(**storm) if storm else "not run"),
        ("Result", "pass" if passed(report) else "FAIL"),
    ]  # fmt: skip
    return doc.section(
        "soak", "Latest run", command, "", *doc.table("Figure | Value", "ll", rows),
        *doc.sub("Calls by kind and status", *doc.table("Kind | Statuses", "ll", statuses(report["by_kind"]))),
        *doc.sub("Calls by tenant and status", *doc.table("Tenant | Statuses", "ll", statuses(report["by_tenant"]))),
    ).text  # fmt: skip


def run(args: argparse.Namespace) -> doc.Section:
    if args.minutes <= 0 or args.rate <= 0 or args.concurrency < 1:
        print("soak: --minutes, --rate and --concurrency must be positive", file=sys.stderr)
        raise SystemExit(2)
    report = soak(args)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.write_doc:
        args.out = Path(args.doc)
    if not passed(report):
        doc.log(f"soak: FAIL: {report['bad']} violations={report['violations'][:5]} alive={report['server_alive']}")
    return doc.Section("soak", render_doc(report, args.command), passed(report))
