"""`make bench`: in-process `generate` vs the simple and batched engines, side by side in one run.

(a) in-process ``model.generate`` at batch 1 and at static batch 16 (the library's own
ceiling), (b) a server with ``--engine simple``, (c) a server with ``--engine batched``,
each at concurrency 1, 4 and 16, all on the same prompts (chat-templated) with the
same fixed ``max_new_tokens`` and ``ignore_eos``, so every run does the same work.
Writes docs/benchmarks.md (machine, versions, the table, ratios against the targets)
and docs/benchmarks.png. The machine is shared and noisy: read the ratios, not the
absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.doc import replace_section

CONCURRENCY = (1, 4, 16)


@dataclasses.dataclass
class Row:
    engine: str
    concurrency: int
    requests: int
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    errors: dict[str, int]
    peak_rss_mb: float | None = None


def chat_prompts(tokenizer: Any, prompts: tuple[str, ...]) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in prompts
    ]


def in_process(model_name: str, batch: int, repeats: int, max_new: int, prompts: tuple[str, ...]) -> Row:
    """``model.generate`` in this process: the reference the server is measured against."""
    import torch
    from tokenwire.bench import percentile
    from tokenwire_server.model import load_model
    from transformers.generation.streamers import BaseStreamer

    loaded = in_process.cache.get(model_name)  # type: ignore[attr-defined]
    if loaded is None:
        loaded = load_model(model_name)
        in_process.cache[model_name] = loaded  # type: ignore[attr-defined]
    tokenizer, model = loaded.tokenizer, loaded.model
    encoded = chat_prompts(tokenizer, prompts)
    tokenizer.padding_side = "left"

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens = 0
    elapsed = 0.0
    for r in range(repeats):
        rows = [encoded[(r * batch + i) % len(encoded)] for i in range(batch)]
        inputs = tokenizer.pad({"input_ids": rows}, return_tensors="pt").to(loaded.device)
        clock = Clock() if batch == 1 else None
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=loaded.pad_token_id,
                streamer=clock,
            )
        done = time.perf_counter()
        elapsed += done - started
        tokens += batch * max_new
        e2e.append(done - started)
        if clock is not None:
            stamps = clock.times[1:]  # the first put() is the prompt
            ttft.append(stamps[0] - started)
            itl.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    ms = 1000.0
    return Row(
        engine="in-process generate" + (" (static batch)" if batch > 1 else ""),
        concurrency=batch,
        requests=repeats * batch,
        tokens_per_s=tokens / elapsed,
        ttft_p50=percentile(ttft, 50) * ms if ttft else None,
        ttft_p99=percentile(ttft, 99) * ms if ttft else None,
        itl_p50=percentile(itl, 50) * ms if itl else None,
        itl_p99=percentile(itl, 99) * ms if itl else None,
        e2e_p50=percentile(e2e, 50) * ms,  # type: ignore[operator]
        e2e_p99=percentile(e2e, 99) * ms,  # type: ignore[operator]
        errors={},
    )


in_process.cache = {}  # type: ignore[attr-defined]


def through_server(engine: str, model_name: str, max_new: int, requests_per_stream: int, extra: list[str]) -> list[Row]:
    from tokenwire.bench import run_bench

    from benchmarks.launcher import ServerProcess, process_status

    rows = []
    args = ["--model", model_name, "--engine", engine, *extra]
    # The vllm engine runs in its own venv (`make setup-vllm`): vLLM pins its own torch and transformers.
    python = os.environ.get("VLLM_PYTHON", ".venv-vllm/bin/python") if engine == "vllm" else None
    with ServerProcess(args, ready_timeout=900, python=python) as server:
        # One short warm-up round so lazy initialisation is not counted.
        run_bench(server.target, concurrency=1, requests=1, max_new_tokens=4)
        for concurrency in CONCURRENCY:
            report = run_bench(
                server.target,
                concurrency=concurrency,
                requests=max(4, concurrency * requests_per_stream),
                max_new_tokens=max_new,
                timeout=3600,
            )
            peak = process_status(server.proc.pid).get("peak_rss_kib")
            rows.append(
                Row(
                    engine=f"server --engine {engine}",
                    concurrency=concurrency,
                    requests=report.requests,
                    tokens_per_s=report.output_tokens_per_s,
                    ttft_p50=report.ttft_ms.p50,
                    ttft_p99=report.ttft_ms.p99,
                    itl_p50=report.itl_ms.p50,
                    itl_p99=report.itl_ms.p99,
                    e2e_p50=report.e2e_ms.p50,
                    e2e_p99=report.e2e_ms.p99,
                    errors=report.errors,
                    peak_rss_mb=peak / 1024 if peak else None,
                )
            )
            print(f"  {engine:>8} c={concurrency:<3} {report.output_tokens_per_s:7.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def cancel_steps(model_name: str, prompts: tuple[str, ...], streams: int = 8, cancels: int = 16) -> list[int]:
    """Decode steps that still included a stream after its cancel, for ``cancels`` streams
    cancelled mid-generation inside a running batch of ``streams`` (the batched engine,
    in-process: only the engine knows how many steps it ran)."""
    import random

    from tokenwire_server.domain import GenerationRequest, SamplingOptions
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits
    from tokenwire_server.engine.batched import BatchedEngine
    from tokenwire_server.model import load_model

    loaded = load_model(model_name)
    encoded = chat_prompts(loaded.tokenizer, prompts)
    engine = create_engine("batched", loaded, EngineLimits(streams, streams, 1 << 20), 1)
    assert isinstance(engine, BatchedEngine)
    engine.start()
    rng = random.Random(0)
    counts: list[int] = []

    def submit(i: int) -> Any:
        request = GenerationRequest(f"c{i}", encoded[i % len(encoded)], SamplingOptions(temperature=0.0), 10_000, ignore_eos=True)
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
    """(ITL p50 before ``arrived``, largest gap overlapping ``[arrived, last]``), in the
    units of the timestamps. ``arrivals``: each decoding stream's chunk arrival times."""
    from tokenwire.bench import percentile

    before: list[float] = []
    worst = 0.0
    for times in arrivals:
        for a, b in zip(times, times[1:], strict=False):
            if b <= arrived:
                before.append(b - a)
            elif a < last:
                worst = max(worst, b - a)
    p50 = percentile(before, 50)
    if p50 is None:
        raise ValueError("no gaps before the long prompt arrived")
    return p50, worst


LONG_PROMPT_FILLER = " ".join(f"item {i} is {i * 7 % 13}." for i in range(400))


def long_prompt(
    model_name: str, repeats: int, streams: int = 8, prompt_tokens: int = 1500, extra: list[str] | None = None, stream_tokens: int = 2000
) -> list[LongPromptRun]:
    """#10's long-prompt case over gRPC, ``repeats`` times on one batched server: ``streams``
    chat streams decode (greedy, ``ignore_eos``); once each has 20 chunks, a
    ``prompt_tokens``-token prompt arrives (as token ids); the streams' largest gap while
    it is read, against their ITL p50 before it came."""
    import threading

    from tokenwire import NO_RETRY, Client, TokenwireError
    from tokenwire.bench import DEFAULT_PROMPTS

    from benchmarks.launcher import ServerProcess

    runs: list[LongPromptRun] = []
    with ServerProcess(["--model", model_name, "--engine", "batched", *(extra or [])], ready_timeout=600) as server, Client(server.target, retry=NO_RETRY) as client:
        ids = client.tokenize(LONG_PROMPT_FILLER).ids[:prompt_tokens]
        if len(ids) < prompt_tokens:
            raise ValueError(f"the filler is only {len(ids)} tokens")
        client.generate_text(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=4)  # warm-up
        for repeat in range(repeats):
            arrivals: list[list[float]] = [[] for _ in range(streams)]
            calls = [
                client.generate(messages=[{"role": "user", "content": DEFAULT_PROMPTS[(repeat * streams + i) % len(DEFAULT_PROMPTS)]}], max_new_tokens=stream_tokens, ignore_eos=True, token_ids=True)
                for i in range(streams)
            ]

            failures: list[TokenwireError] = []

            def read(call: Any, times: list[float], failures: list[TokenwireError]) -> None:
                try:
                    for _ in call:
                        times.append(time.perf_counter())
                except TokenwireError as exc:  # CANCELLED below, or a refusal
                    failures.append(exc)

            readers = [threading.Thread(target=read, args=(call, times, failures), daemon=True) for call, times in zip(calls, arrivals, strict=True)]
            for reader in readers:
                reader.start()
            while min(len(times) for times in arrivals) < 20:
                if failures or not all(reader.is_alive() for reader in readers):
                    raise RuntimeError(f"a decoding stream ended before its 20th chunk: {failures[:1] or 'finished early'}")
                time.sleep(0.01)
            arrived = time.perf_counter()
            chunks = [time.perf_counter() for _ in client.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True, token_ids=True)]
            time.sleep(0.5)  # a few steps after its last chunk, then stop the others
            for call in calls:
                call.cancel()
            for reader in readers:
                reader.join(60)
            p50, worst = stall([list(times) for times in arrivals], arrived, chunks[-1])
            runs.append(LongPromptRun(p50 * 1000, worst * 1000, chunks[0] - arrived, len(ids)))
            print(f"  long prompt {repeat}: largest gap {worst * 1000:.0f} ms, ITL p50 {p50 * 1000:.0f} ms ({worst / p50:.2f}x)", file=sys.stderr, flush=True)
    return runs


@dataclasses.dataclass
class SingleStreamAB:
    pairs: int
    tokens_per_s_ratio: float  # median over pairs of server / in-process
    ttft_delta_ms: float  # median over pairs of server TTFT - in-process TTFT
    in_process_tokens_per_s: float
    server_tokens_per_s: float
    in_process_ttft_ms: float
    server_ttft_ms: float


def single_stream_ab(model_name: str, max_new: int, pairs: int, prompts: tuple[str, ...]) -> SingleStreamAB:
    """One stream, in-process ``generate`` and the batched server alternating request by
    request on the same prompt: minutes of machine noise cancel out of each pair."""
    from tokenwire.bench import run_bench

    from benchmarks.launcher import ServerProcess

    ratios, deltas, local_tps, remote_tps, local_ttft, remote_ttft = [], [], [], [], [], []
    with ServerProcess(["--model", model_name, "--engine", "batched"], ready_timeout=600) as server:
        run_bench(server.target, concurrency=1, requests=1, max_new_tokens=4)
        in_process(model_name, 1, 1, 4, prompts)
        for i in range(pairs):
            prompt = (prompts[i % len(prompts)],)
            local = in_process(model_name, 1, 1, max_new, prompt)
            remote = run_bench(server.target, concurrency=1, requests=1, max_new_tokens=max_new, prompts=prompt, timeout=600)
            assert local.ttft_p50 is not None and remote.ttft_ms.p50 is not None
            ratios.append(remote.output_tokens_per_s / local.tokens_per_s)
            deltas.append(remote.ttft_ms.p50 - local.ttft_p50)
            local_tps.append(local.tokens_per_s)
            remote_tps.append(remote.output_tokens_per_s)
            local_ttft.append(local.ttft_p50)
            remote_ttft.append(remote.ttft_ms.p50)
    med = statistics.median
    return SingleStreamAB(
        pairs, med(ratios), med(deltas), med(local_tps), med(remote_tps), med(local_ttft), med(remote_ttft)
    )


def machine() -> dict[str, str]:
    import torch
    import transformers
    from tokenwire_server.model import cpu_instruction_sets

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "instruction sets": ", ".join(cpu_instruction_sets()) or "none of note",
        "cores": str(os.cpu_count()),
        "gpu": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch threads": str(torch.get_num_threads()),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def find(rows: list[Row], engine: str, concurrency: int) -> Row | None:
    for row in rows:
        if row.engine.startswith(engine) and row.concurrency == concurrency:
            return row
    return None


def targets(rows: list[Row], ab: SingleStreamAB | None, long_runs: list[LongPromptRun] | None = None) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met): the first issue's targets 1-4 and 6, and #10's long prompt."""
    out: list[tuple[str, str, bool | None]] = []
    b16, s16, g16 = find(rows, "server --engine batched", 16), find(rows, "server --engine simple", 16), find(rows, "in-process generate (static", 16)
    if b16 and s16:
        ratio = b16.tokens_per_s / s16.tokens_per_s
        out.append(("c=16: batched tok/s >= 5x simple", f"{ratio:.2f}x", ratio >= 5))
    if b16 and g16:
        ratio = b16.tokens_per_s / g16.tokens_per_s
        out.append(("c=16: batched tok/s >= 0.8x in-process static batch 16", f"{ratio:.2f}x", ratio >= 0.8))
    if ab is not None:
        ratio = ab.tokens_per_s_ratio
        out.append(
            (
                "c=1: batched tok/s over gRPC >= 0.95x in-process batch 1 (interleaved pairs)",
                f"{ratio:.2f}x (median of {ab.pairs} pairs; {ab.server_tokens_per_s:.1f} vs {ab.in_process_tokens_per_s:.1f} tok/s)",
                ratio >= 0.95,
            )
        )
    if b16 and b16.itl_p50 and b16.itl_p99:
        ratio = b16.itl_p99 / b16.itl_p50
        out.append(("c=16: batched ITL p99 <= 2.5x p50", f"{ratio:.2f}x ({b16.itl_p99:.1f} / {b16.itl_p50:.1f} ms)", ratio <= 2.5))
    if ab is not None:
        delta = ab.ttft_delta_ms
        out.append(
            (
                "c=1: TTFT p50 <= in-process TTFT + 15 ms (interleaved pairs)",
                f"{delta:+.1f} ms (median of {ab.pairs} pairs; {ab.server_ttft_ms:.1f} vs {ab.in_process_ttft_ms:.1f} ms)",
                delta <= 15,
            )
        )
    if b16 and b16.peak_rss_mb:
        out.append(("c=16: batched server peak RSS <= 1.5 GB", f"{b16.peak_rss_mb:.0f} MB", b16.peak_rss_mb <= 1536))
    if long_runs:
        ratios = [run.ratio for run in long_runs]
        median = statistics.median(ratios)
        out.append(
            (
                f"long prompt: {long_runs[0].prompt_tokens} tokens arriving among 8 decoding streams raises their largest gap <= 3x their ITL p50",
                f"{median:.2f}x (median of {len(ratios)}: {', '.join(f'{r:.2f}' for r in ratios)})",
                median <= 3,
            )
        )
    return out


def write_markdown(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    lines = [
        "## In-process `generate` and the tokenwire engines (`make bench`)",
        "",
        f"Written by `{meta['command']}`; do not edit by hand.",
        "Every row ran in the same invocation on the same machine, one after another; the",
        "machine is shared and noisy, so compare the ratios, not the absolute figures.",
        "",
        f"Work per request: a chat prompt from a fixed set of {meta['prompts']}, `max_new_tokens={meta['max_new_tokens']}`,",
        "`ignore_eos` (every request generates exactly that many tokens), greedy. Concurrency *c*",
        "means *c* client streams kept busy (closed loop) through gRPC on 127.0.0.1; for in-process",
        "`generate` it is the batch size (static batch: all rows start and end together).",
        "Latencies are milliseconds, seen by the client. ITL = gap between streamed tokens.",
        "",
        "### Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in meta["machine"].items()]
    lines += [f"| run at | {meta['when']} |", f"| model | {meta['model']} (float32) |", ""]
    lines += [
        "### Results",
        "",
        "| engine | c | requests | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | e2e p50 | e2e p99 | peak RSS MB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        errors = ", ".join(f"{k}: {v}" for k, v in r.errors.items()) or "0"
        lines.append(
            f"| {r.engine} | {r.concurrency} | {r.requests} | {r.tokens_per_s:.1f} | {_fmt(r.ttft_p50)} | {_fmt(r.ttft_p99)} "
            f"| {_fmt(r.itl_p50)} | {_fmt(r.itl_p99)} | {_fmt(r.e2e_p50, 0)} | {_fmt(r.e2e_p99, 0)} | {_fmt(r.peak_rss_mb, 0)} | {errors} |"
        )
    lines += ["", "### Ratios", ""]
    base_simple = {r.concurrency: r for r in rows if r.engine == "server --engine simple"}
    lines += ["| c | batched / simple | batched / in-process generate |", "|---:|---:|---:|"]
    for c in CONCURRENCY:
        b = find(rows, "server --engine batched", c)
        s = base_simple.get(c)
        g = find(rows, "in-process generate", c)
        lines.append(
            f"| {c} | {_fmt(b.tokens_per_s / s.tokens_per_s, 2) + 'x' if b and s else '-'} "
            f"| {_fmt(b.tokens_per_s / g.tokens_per_s, 2) + 'x' if b and g else '-'} |"
        )
    lines += [
        "",
        "### Targets",
        "",
        "The single-stream targets compare the batched server with in-process `generate` in",
        "interleaved pairs (one request each, same prompt, alternating), because two runs minutes",
        "apart on this shared machine differ by more than the margin being measured.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    long_runs: list[LongPromptRun] = meta.get("long_prompt") or []
    for name, measured, met in targets(rows, meta.get("ab"), long_runs):
        lines.append(f"| {name} | {measured} | {'yes' if met else 'NO'} |")
    if long_runs:
        lines += [
            "",
            "### A long prompt among decoding streams",
            "",
            "`server --engine batched`, over gRPC: 8 chat streams decode (greedy, `ignore_eos`); once each has",
            f"20 chunks, a {long_runs[0].prompt_tokens}-token prompt arrives (token ids, 4 new tokens). The streams' largest gap",
            "between chunks while it is read (until its last chunk) against their ITL p50 before it came;",
            f"{len(long_runs)} arrivals on one server. min / median / max:",
            "",
            "| | min | median | max |",
            "|---|---:|---:|---:|",
        ]
        for label, values in (
            ("ITL p50 before, ms", [run.itl_p50_ms for run in long_runs]),
            ("largest gap while read, ms", [run.max_gap_ms for run in long_runs]),
            ("largest gap / ITL p50", [run.ratio for run in long_runs]),
            ("long prompt's first chunk, s", [run.first_token_s for run in long_runs]),
        ):
            lines.append(f"| {label} | {min(values):.2f} | {statistics.median(values):.2f} | {max(values):.2f} |")
    lines += ["", "![throughput and inter-token latency against concurrency](benchmarks.png)", ""]
    if meta.get("notes"):
        lines += ["### Notes", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    replace_section(path, "bench", "\n".join(lines))


def plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for engine, marker in (("server --engine batched", "o"), ("server --engine simple", "s")):
        points = [r for r in rows if r.engine == engine]
        xs = [r.concurrency for r in points]
        left.plot(xs, [r.tokens_per_s for r in points], marker=marker, label=engine)
        right.plot(xs, [r.itl_p50 or 0 for r in points], marker=marker, label=f"{engine} p50")
        right.plot(xs, [r.itl_p99 or 0 for r in points], marker=marker, linestyle="--", label=f"{engine} p99")
    statics = [r for r in rows if r.engine.startswith("in-process")]
    left.plot([r.concurrency for r in statics], [r.tokens_per_s for r in statics], marker="^", linestyle=":", label="in-process generate (batch = c)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(CONCURRENCY))
        ax.set_xticklabels([str(c) for c in CONCURRENCY])
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("output tokens/s (aggregate)")
    left.set_title("Throughput")
    right.set_ylabel("inter-token latency, ms")
    right.set_title("Inter-token latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per concurrent stream in each run")
    parser.add_argument("--engines", default="simple,batched")
    parser.add_argument("--pairs", type=int, default=12, help="interleaved single-stream pairs (in-process, server)")
    parser.add_argument("--out", default="docs/benchmarks.md")
    parser.add_argument("--plot", default="docs/benchmarks.png")
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--long-repeats", type=int, default=3, help="arrivals of a 1,500-token prompt among 8 decoding streams (0: skip)")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = parser.parse_args(argv)

    from tokenwire.bench import DEFAULT_PROMPTS

    prompts = tuple(DEFAULT_PROMPTS)
    rows: list[Row] = []
    print("in-process generate ...", file=sys.stderr, flush=True)
    rows.append(in_process(args.model, 1, max(4, args.requests_per_stream * 2), args.max_new_tokens, prompts))
    rows.append(in_process(args.model, 4, args.requests_per_stream, args.max_new_tokens, prompts))
    rows.append(in_process(args.model, 16, args.requests_per_stream, args.max_new_tokens, prompts))
    print("one stream: in-process and server, interleaved ...", file=sys.stderr, flush=True)
    ab = single_stream_ab(args.model, args.max_new_tokens, args.pairs, prompts)
    in_process.cache.clear()  # type: ignore[attr-defined]
    print("cancellation inside a batch ...", file=sys.stderr, flush=True)
    cancels = cancel_steps(args.model, prompts)
    for engine in args.engines.split(","):
        print(f"server --engine {engine} ...", file=sys.stderr, flush=True)
        rows.extend(through_server(engine, args.model, args.max_new_tokens, args.requests_per_stream, args.server_arg))
    long_runs: list[LongPromptRun] = []
    if args.long_repeats and "batched" in args.engines.split(","):
        print("a long prompt among decoding streams ...", file=sys.stderr, flush=True)
        long_runs = long_prompt(args.model, args.long_repeats, extra=args.server_arg)
    meta = {
        "command": ("python -m benchmarks.bench " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "machine": machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model if args.model != "default" else "SmolLM2-135M-Instruct (default)",
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "ab": ab,
        "long_prompt": long_runs,
        "notes": [
            f"Cancellation inside a running batch of 8 (batched engine, in-process, {len(cancels)} cancels at random "
            f"moments): decode steps that still included the stream after its cancel: max {max(cancels)}, "
            f"median {statistics.median(cancels):g} (target: at most 2)."
        ],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_markdown(out, rows, meta)
    plot(Path(args.plot), rows)
    print(out.read_text())
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
