"""In-process `generate` vs the simple and batched engines, side by side in one run (`make bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import process_status, serve
from benchmarks.load import Measure
from benchmarks.stats import cell, median, percentile, ratios

CONCURRENCY = (1, 4, 16)
FLAGS = {
    "max_new_tokens": 64, "requests_per_stream": (2, "requests per concurrent stream in each run"),
    "engines": "simple,batched",
    "pairs": (12, "interleaved single-stream pairs (in-process, server)"),
    "cancels": (16, "streams cancelled inside a running batch of 8"),
    "plot": ("docs/benchmarks.png", "where the figure goes ('' for none)"),
    "server_arg": ([], "extra server flag (repeatable)"),
    "long_repeats": (3, "arrivals of a 1,500-token prompt among 8 decoding streams (0: skip)"),
}  # fmt: skip
DRY_RUN = {"max_new_tokens": 4, "requests_per_stream": 1, "pairs": 1, "cancels": 2, "long_repeats": 1, "plot": ""}
LONG_PROMPT_FILLER = " ".join(f"item {i} is {i * 7 % 13}." for i in range(400))
LOADED: dict[tuple[str, str], Any] = {}  # (model name, dtype) -> the model in_process loaded, while a suite runs
BATCHED, SIMPLE, GENERATE = "server --engine batched", "server --engine simple", "in-process generate"


def in_process(
    model_name: str, batch: int, repeats: int, max_new: int, prompts: tuple[str, ...], dtype: str = "auto"
) -> Measure:
    """``model.generate`` in this process (``--dtype`` ``dtype``): the reference the server is measured against."""
    import torch
    from tokenwire_server.model import load_model

    key = (model_name, dtype)
    loaded = LOADED.get(key) or LOADED.setdefault(key, load_model(model_name, dtype=dtype))
    tokenizer, model = loaded.tokenizer, loaded.model
    encoded = [load.chat_ids(tokenizer, p) for p in prompts]
    tokenizer.padding_side = "left"
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    for r in range(repeats):
        rows = [encoded[(r * batch + i) % len(encoded)] for i in range(batch)]
        inputs = tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(loaded.device)
        times: list[float] = []  # a streamer's clock (one row only): the first put() is the prompt
        clock = SimpleNamespace(put=lambda _, t=times: t.append(time.perf_counter()), end=lambda: None)
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           pad_token_id=loaded.pad_token_id, streamer=clock if batch == 1 else None)  # fmt: skip
        e2e.append(time.perf_counter() - started)
        if times:
            ttft.append(times[1] - started)
            itl.extend(b - a for a, b in zip(times[1:], times[2:], strict=False))
    system = GENERATE + (" (static batch)" if batch > 1 else "")
    return Measure.of(system, batch, repeats * batch, repeats * batch * max_new, sum(e2e), ttft, itl, e2e)


def through_server(args: argparse.Namespace, engine: str, prompts: tuple[str, ...]) -> list[Measure]:
    rows = []
    with serve(args.dry_run, ["--model", args.model, *args.server_arg], engine) as server:
        load.warm(server.target)
        for c in CONCURRENCY:
            requests = max(4, c * args.requests_per_stream)
            row = load.grpc_load(server.target, f"server --engine {engine}", c, requests, args.max_new_tokens, prompts)
            peak = process_status(server.proc.pid).get("peak_rss_kib")
            row.rss_mb = peak / 1024 if peak else None
            rows.append(row)
            doc.log(f"  {engine:>8} c={c:<3} {row.tokens_per_s:7.1f} tok/s")
    return rows


def cancel_steps(model_name: str, prompts: tuple[str, ...], cancels: int, streams: int = 8) -> list[int]:
    """Decode steps that still included a stream after its cancel, for ``cancels`` streams cancelled inside a running
    batch of ``streams`` (the batched engine in process: only it counts its steps)."""
    import random

    from tokenwire_server.domain import GenerationRequest, SamplingOptions
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.model import load_model

    loaded = load_model(model_name)
    encoded = [load.chat_ids(loaded.tokenizer, p) for p in prompts]
    engine: Any = create_engine("batched", loaded, EngineLimits(streams, streams, 1 << 20), 1)
    engine.start()
    rng = random.Random(0)
    counts: list[int] = []

    def submit(i: int) -> Any:
        request = GenerationRequest(f"c{i}", encoded[i % len(encoded)], SamplingOptions(0.0), 10_000, ignore_eos=True)
        return engine.submit(request, lambda event: None)

    try:
        live = [submit(i) for i in range(streams)]
        for n in range(cancels):
            time.sleep(rng.uniform(0.2, 0.8))
            victim = live.pop(rng.randrange(len(live)))
            at_cancel = engine.steps
            victim.cancel()
            victim.done.wait(30)
            counts.append(engine.steps - at_cancel)
            live.append(submit(streams + n))
        for handle in live:
            handle.cancel()
    finally:
        engine.close()
    return counts


@dataclasses.dataclass
class LongPromptRun:
    """One arrival of a long prompt among decoding streams, seen by the clients."""

    itl_p50_ms: float  # the decoding streams' gap between chunks before it arrived
    max_gap_ms: float  # their largest gap while it was read (until its last chunk)
    first_token_s: float  # the long prompt's own time to first chunk
    prompt_tokens: int

    @property
    def ratio(self) -> float:
        return self.max_gap_ms / self.itl_p50_ms


def stall(arrivals: list[list[float]], arrived: float, last: float) -> tuple[float, float]:
    """(ITL p50 before ``arrived``, largest gap overlapping ``[arrived, last]``) of each decoding stream's chunk
    arrival times."""
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    p50 = percentile([b - a for a, b in gaps if b <= arrived], 50)
    if p50 is None:
        raise ValueError("no gaps before the long prompt arrived")
    return p50, max((b - a for a, b in gaps if b > arrived and a < last), default=0.0)


def long_prompt(
    model_name: str, repeats: int, streams: int = 8, prompt_tokens: int = 1500, extra: list[str] | None = None,
    stream_tokens: int = 2000, dry_run: bool = False,
) -> list[LongPromptRun]:  # fmt: skip
    """#10's long-prompt case over gRPC, ``repeats`` times on one batched server: once each of ``streams`` decoding
    chat streams has 20 chunks, a ``prompt_tokens``-token prompt arrives (as token ids)."""
    from tokenwire import NO_RETRY, Client, TokenwireError
    from tokenwire.bench import DEFAULT_PROMPTS

    runs: list[LongPromptRun] = []
    flags = ["--model", model_name, *(extra or [])]
    with serve(dry_run, flags, "batched", ready_timeout=600) as server, Client(server.target, retry=NO_RETRY) as client:
        ids = client.tokenize(LONG_PROMPT_FILLER).ids[:prompt_tokens]
        if len(ids) < prompt_tokens:
            raise ValueError(f"the filler is only {len(ids)} tokens")
        client.generate_text(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=4)  # warm-up
        for repeat in range(repeats):
            arrivals: list[list[float]] = [[] for _ in range(streams)]
            failures: list[TokenwireError] = []
            asks = [DEFAULT_PROMPTS[(repeat * streams + i) % len(DEFAULT_PROMPTS)] for i in range(streams)]
            calls = [client.generate(messages=[{"role": "user", "content": ask}], max_new_tokens=stream_tokens,
                                     ignore_eos=True, token_ids=True) for ask in asks]  # fmt: skip

            def read(call: Any, times: list[float], failures: list[TokenwireError] = failures) -> None:
                try:
                    for _ in call:
                        times.append(time.perf_counter())
                except TokenwireError as exc:  # CANCELLED below, or a refusal
                    failures.append(exc)

            pairs = zip(calls, arrivals, strict=True)
            readers = [threading.Thread(target=read, args=pair, daemon=True) for pair in pairs]
            for reader in readers:
                reader.start()
            while min(len(times) for times in arrivals) < 20:
                if failures or not all(reader.is_alive() for reader in readers):
                    why = failures[:1] or "finished early"
                    raise RuntimeError(f"a decoding stream ended before its 20th chunk: {why}")
                time.sleep(0.01)
            arrived = time.perf_counter()
            long_call = client.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True, token_ids=True)
            chunks = [time.perf_counter() for _ in long_call]
            time.sleep(0.5)  # a few steps after its last chunk, then stop the others
            for call in calls:
                call.cancel()
            for reader in readers:
                reader.join(60)
            p50, worst = stall([list(times) for times in arrivals], arrived, chunks[-1])
            runs.append(LongPromptRun(p50 * 1000, worst * 1000, chunks[0] - arrived, len(ids)))
            doc.log(f"  long prompt {repeat}: largest gap {worst * 1e3:.0f} ms, ({worst / p50:.2f}x ITL p50)")
    return runs


def single_stream_pairs(args: argparse.Namespace, prompts: tuple[str, ...]) -> list[tuple[Measure, Measure]]:
    """One stream, in-process ``generate`` and the batched server alternating on the same prompt: (in-process,
    server) pairs, out of which minutes of machine noise cancel."""
    pairs = []
    with serve(args.dry_run, ["--model", args.model], "batched", ready_timeout=600) as server:
        load.warm(server.target)
        in_process(args.model, 1, 1, 4, prompts)
        for i in range(args.pairs):
            prompt = (prompts[i % len(prompts)],)
            local = in_process(args.model, 1, 1, args.max_new_tokens, prompt)
            pairs.append((local, load.grpc_load(server.target, "batched", 1, 1, args.max_new_tokens, prompt)))
    return pairs


def find(rows: list[Measure], system: str, concurrency: int) -> Measure | None:
    return next((r for r in rows if r.system.startswith(system) and r.concurrency == concurrency), None)


def targets(
    rows: list[Measure], pairs: list[tuple[Measure, Measure]], long_runs: list[LongPromptRun]
) -> list[tuple[str, str, bool]]:
    """(target, measured, met): the first issue's targets 1-4 and 6, and #10's long prompt."""
    out: list[tuple[str, str, bool]] = []
    b16, s16, g16 = find(rows, BATCHED, 16), find(rows, SIMPLE, 16), find(rows, GENERATE + " (static", 16)
    for other, name, bound in ((s16, "simple", 5), (g16, "in-process static batch 16", 0.8)):
        if b16 and other:
            ratio = b16.tokens_per_s / other.tokens_per_s
            out.append((f"c=16: batched tok/s >= {bound:g}x {name}", f"{ratio:.2f}x", ratio >= bound))
    local_tps, server_tps = [a.tokens_per_s for a, _ in pairs], [b.tokens_per_s for _, b in pairs]
    local_ttft, server_ttft = [a.ttft_p50 or 0.0 for a, _ in pairs], [b.ttft_p50 or 0.0 for _, b in pairs]
    ratio, of = median(ratios(server_tps, local_tps)), f"median of {len(pairs)} pairs"
    out.append(("c=1: batched tok/s over gRPC >= 0.95x in-process batch 1 (interleaved pairs)",
                f"{ratio:.2f}x ({of}; {median(server_tps):.1f} vs {median(local_tps):.1f} tok/s)",
                ratio >= 0.95))  # fmt: skip
    if b16 and b16.itl_p50 and b16.itl_p99:
        ratio = b16.itl_p99 / b16.itl_p50
        measured = f"{ratio:.2f}x ({b16.itl_p99:.1f} / {b16.itl_p50:.1f} ms)"
        out.append(("c=16: batched ITL p99 <= 2.5x p50", measured, ratio <= 2.5))
    delta = median(b - a for a, b in zip(local_ttft, server_ttft, strict=True))
    out.append(("c=1: TTFT p50 <= in-process TTFT + 15 ms (interleaved pairs)",
                f"{delta:+.1f} ms ({of}; {median(server_ttft):.1f} vs {median(local_ttft):.1f} ms)",
                delta <= 15))  # fmt: skip
    if b16 and b16.rss_mb:
        out.append(("c=16: batched server peak RSS <= 1.5 GB", f"{b16.rss_mb:.0f} MB", b16.rss_mb <= 1536))
    if long_runs:
        stalls = [run.ratio for run in long_runs]
        out.append((f"long prompt: {long_runs[0].prompt_tokens} tokens arriving among 8 decoding streams raises their "
                    "largest gap <= 3x their ITL p50",
                    f"{median(stalls):.2f}x (median of {len(stalls)}: {', '.join(f'{r:.2f}' for r in stalls)})",
                    median(stalls) <= 3))  # fmt: skip
    return out


def render(args: argparse.Namespace, rows: list[Measure], pairs: list[tuple[Measure, Measure]],
           long_runs: list[LongPromptRun], cancels: list[int], prompts: int) -> doc.Section:  # fmt: skip
    model = args.model if args.model != "default" else "SmolLM2-135M-Instruct (default)"
    by_c = []
    for c in CONCURRENCY:
        b, s, g = (find(rows, e, c) for e in (BATCHED, SIMPLE, GENERATE))
        by_c.append([c, *(f"{b.tokens_per_s / o.tokens_per_s:.2f}x" if b and o else "-" for o in (s, g))])
    stalls = (("ITL p50 before, ms", [run.itl_p50_ms for run in long_runs]),
              ("largest gap while read, ms", [run.max_gap_ms for run in long_runs]),
              ("largest gap / ITL p50", [run.ratio for run in long_runs]),
              ("long prompt's first chunk, s", [run.first_token_s for run in long_runs]))  # fmt: skip
    lines = [
        "Every row ran in the same invocation on the same machine, one after another; the machine is shared and "
        "noisy, so compare the ratios, not the absolute figures.",
        "",
        f"Work per request: a chat prompt from a fixed set of {prompts}, `max_new_tokens={args.max_new_tokens}`, "
        "`ignore_eos` (every request generates exactly that many tokens), greedy. Concurrency *c* means *c* client "
        "streams kept busy (closed loop) through gRPC on 127.0.0.1; for in-process `generate` it is the batch size "
        "(static batch: all rows start and end together). Latencies are milliseconds, seen by the client. ITL = gap "
        "between streamed tokens.",
        *doc.sub("Machine", *doc.table("|", "ll", [*doc.machine().items(), ("model", f"{model} (float32)")])),
        *doc.sub("Results", *doc.table(
            "engine | c | requests | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | e2e p50 | e2e p99 | "
            "peak RSS MB | errors", "lrrrrrrrrrrl",
            ([r.system, r.concurrency, r.requests, f"{r.tokens_per_s:.1f}", cell(r.ttft_p50), cell(r.ttft_p99),
              cell(r.itl_p50), cell(r.itl_p99), cell(r.e2e_p50, 0), cell(r.e2e_p99, 0), cell(r.rss_mb, 0),
              ", ".join(f"{k}: {v}" for k, v in r.errors.items()) or "0"] for r in rows))),
        *doc.sub("Ratios", *doc.table("c | batched / simple | batched / in-process generate", "rrr", by_c)),
        *doc.sub("Targets", "The single-stream targets compare the batched server with in-process `generate` in "
                 "interleaved pairs (one request each, same prompt, alternating), because two runs minutes apart on "
                 "this shared machine differ by more than the margin being measured.", "",
                 *doc.table("target | measured | met", "lll",
                            ((n, m, "yes" if ok else "NO") for n, m, ok in targets(rows, pairs, long_runs)))),
        *(doc.sub("A long prompt among decoding streams",
                  "`server --engine batched`, over gRPC: 8 chat streams decode (greedy, `ignore_eos`); once each has "
                  f"20 chunks, a {long_runs[0].prompt_tokens}-token prompt arrives (token ids, 4 new tokens). The "
                  "streams' largest gap between chunks while it is read (until its last chunk) against their ITL p50 "
                  f"before it came; {len(long_runs)} arrivals on one server. min / median / max:", "",
                  *doc.table("| min | median | max", "lrrr",
                             ([label, *(f"{f(v):.2f}" for f in (min, median, max))] for label, v in stalls)))
          if long_runs else []),
        "",
        "![throughput and inter-token latency against concurrency](benchmarks.png)",
        *doc.sub("Notes", f"- Cancellation inside a running batch of 8 (batched engine, in-process, {len(cancels)} "
                 f"cancels at random moments): decode steps that still included the stream after its cancel: max "
                 f"{max(cancels)}, median {median(cancels):g} (target: at most 2).", ""),
    ]  # fmt: skip
    return doc.section("bench", "In-process `generate` and the tokenwire engines (`make bench`)", args.command, *lines)


def plot(path: Path, rows: list[Measure]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, marker in ((BATCHED, "o"), (SIMPLE, "s")):
        points = [r for r in rows if r.system == system]
        xs = [r.concurrency for r in points]
        left.plot(xs, [r.tokens_per_s for r in points], marker=marker, label=system)
        right.plot(xs, [r.itl_p50 or 0 for r in points], marker=marker, label=f"{system} p50")
        right.plot(xs, [r.itl_p99 or 0 for r in points], marker=marker, linestyle="--", label=f"{system} p99")
    statics = [r for r in rows if r.system.startswith("in-process")]
    left.plot([r.concurrency for r in statics], [r.tokens_per_s for r in statics], marker="^", linestyle=":",
              label="in-process generate (batch = c)")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set(xticks=list(CONCURRENCY), xticklabels=[str(c) for c in CONCURRENCY], xlabel="concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set(ylabel="output tokens/s (aggregate)", title="Throughput")
    right.set(ylabel="inter-token latency, ms", title="Inter-token latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> doc.Section:
    from tokenwire.bench import DEFAULT_PROMPTS

    prompts = tuple(DEFAULT_PROMPTS)
    engines = args.engines.split(",")
    doc.log("in-process generate ...")
    rows = [in_process(args.model, batch, repeats, args.max_new_tokens, prompts)
            for batch, repeats in ((1, max(4, args.requests_per_stream * 2)), (4, args.requests_per_stream),
                                   (16, args.requests_per_stream))]  # fmt: skip
    doc.log("one stream: in-process and server, interleaved ...")
    pairs = single_stream_pairs(args, prompts)
    LOADED.clear()
    doc.log("cancellation inside a batch ...")
    cancels = cancel_steps(args.model, prompts, args.cancels)
    for engine in engines:
        doc.log(f"server --engine {engine} ...")
        rows += through_server(args, engine, prompts)
    long_runs: list[LongPromptRun] = []
    if args.long_repeats and "batched" in engines:
        doc.log("a long prompt among decoding streams ...")
        long_runs = long_prompt(args.model, args.long_repeats, extra=args.server_arg, dry_run=args.dry_run)
    if args.plot:
        plot(Path(args.plot), rows)
    return render(args, rows, pairs, long_runs, cancels, len(prompts))
