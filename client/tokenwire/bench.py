"""Load a running server with concurrent streams and measure it from the client's side.

``run_bench`` (or ``run_bench_async`` inside an event loop) drives ``concurrency``
streams at once over a fixed prompt set, each asking for exactly ``max_new_tokens``
tokens (``ignore_eos``) so every run does the same work, and returns a
:class:`BenchReport`: throughput, time to first token, inter-token latency (the gap
between chunk arrivals, spread over the tokens each chunk carries), end-to-end
latency and errors by status code. ``tokenwire bench`` and the server's
``make bench`` both use it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from tokenwire.aio import AsyncClient
from tokenwire.channel import TLSConfig
from tokenwire.errors import TokenwireError
from tokenwire.results import Message
from tokenwire.retry import NO_RETRY, RetryPolicy

__all__ = [
    "DEFAULT_PROMPTS",
    "BenchReport",
    "LatencySummary",
    "ProgressBar",
    "percentile",
    "run_bench",
    "run_bench_async",
]

# Short chat prompts; each request takes the next one in turn.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain gravity to a five-year-old.",
    "Give me three tips for better sleep.",
    "What does a compiler do?",
    "Name a few uses of a paperclip.",
    "Describe a sunset in two sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "What is the difference between a list and a tuple in Python?",
    "Tell me a short story about a robot who learns to paint.",
    "How do plants make food?",
    "What are the planets of the solar system?",
    "Give a recipe for a simple tomato soup.",
    "Summarise the rules of chess in a few lines.",
    "What is a good way to learn a new language?",
)

ProgressCallback = Callable[[int, int | None, float, int, int], None]
"""Called as progress(done, total or None, elapsed_s, output_tokens, errors)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """Milliseconds; None where nothing was measured."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencySummary:
        ms = [s * 1000 for s in seconds]
        return cls(
            count=len(ms),
            mean=sum(ms) / len(ms) if ms else None,
            p50=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
            max=max(ms) if ms else None,
        )


@dataclasses.dataclass(frozen=True)
class BenchReport:
    target: str
    concurrency: int
    max_new_tokens: int
    requests: int
    succeeded: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: LatencySummary
    itl_ms: LatencySummary
    e2e_ms: LatencySummary
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def format(self) -> str:
        """A human-readable table."""

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        lines = [
            f"target              {self.target}",
            f"concurrency         {self.concurrency}",
            f"max_new_tokens      {self.max_new_tokens}",
            f"requests            {self.requests} ({self.succeeded} ok, {self.failed} failed)",
            f"duration            {self.duration_s:.2f} s",
            f"output tokens       {self.output_tokens}",
            f"output tokens/s     {self.output_tokens_per_s:.1f}",
            f"requests/s          {self.requests_per_s:.2f}",
        ]
        for label, summary in (("TTFT", self.ttft_ms), ("inter-token", self.itl_ms), ("end-to-end", self.e2e_ms)):
            lines.append(f"{label:<19} p50 {ms(summary.p50)}  p99 {ms(summary.p99)}  mean {ms(summary.mean)}")
        if self.errors:
            lines.append("errors              " + ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())))
        return "\n".join(lines)


class ProgressBar:
    """A plain-text progress bar on a terminal (nothing when the stream is not one)."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30, interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.width = width
        self.interval = interval
        self._last = 0.0

    def __call__(self, done: int, total: int | None, elapsed: float, tokens: int, errors: int) -> None:
        now = time.monotonic()
        final = total is not None and done >= total
        if not self.enabled or (now - self._last < self.interval and not final):
            return
        self._last = now
        fraction = min(1.0, done / total) if total else 0.0
        filled = int(self.width * fraction)
        bar = "#" * filled + "-" * (self.width - filled)
        rate = tokens / elapsed if elapsed > 0 else 0.0
        count = f"{done}/{total}" if total else f"{done}"
        self.stream.write(f"\r[{bar}] {count} req  {elapsed:5.1f} s  {rate:8.1f} tok/s  {errors} err ")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclasses.dataclass
class _Totals:
    issued: int = 0
    done: int = 0
    succeeded: int = 0
    tokens: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    ttft: list[float] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: list[float] = dataclasses.field(default_factory=list)


async def _one_request(client: AsyncClient, prompt: str, chat: bool, params: dict[str, Any], totals: _Totals) -> None:
    started = time.perf_counter()
    first: float | None = None
    last = started
    tokens = 0
    usage_tokens: int | None = None
    itl: list[float] = []
    stream = (
        client.generate(messages=[Message("user", prompt)], **params) if chat else client.generate(prompt, **params)
    )
    try:
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                n = len(chunk.tokens)
                if first is None:
                    if not (n or chunk.text):
                        continue
                    first = last = now
                elif n:
                    # A chunk that carries several tokens spreads its gap over them.
                    itl.extend([(now - last) / n] * n)
                    last = now
                tokens += n
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
    except TokenwireError as error:
        totals.errors[error.code.name] = totals.errors.get(error.code.name, 0) + 1
        totals.tokens += tokens
        return
    finished = time.perf_counter()
    totals.succeeded += 1
    totals.tokens += usage_tokens if usage_tokens is not None else tokens
    if first is not None:
        totals.ttft.append(first - started)
    totals.itl.extend(itl)
    totals.e2e.append(finished - started)


async def run_bench_async(
    target: str | Sequence[str],
    concurrency: int = 4,
    requests: int | None = None,
    max_new_tokens: int = 64,
    *,
    duration: float | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    chat: bool = True,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    tls: bool | TLSConfig = False,
    token: str | None = None,
    timeout: float | None = None,
    retry: RetryPolicy = NO_RETRY,
    progress: ProgressCallback | None = None,
) -> BenchReport:
    """Run the benchmark; see the module docstring. Without ``requests`` or ``duration``
    it sends ``8 * concurrency`` requests; with both, whichever ends first.
    Refusals are not retried by default (``retry``), so that overload shows as errors."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if not prompts:
        raise ValueError("the prompt set is empty")
    if requests is None and duration is None:
        requests = 8 * concurrency
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "token_ids": True}
    if temperature is not None:
        params["temperature"] = temperature
    if top_p is not None:
        params["top_p"] = top_p
    if seed is not None:
        params["seed"] = seed
    totals = _Totals()
    started = time.perf_counter()

    def report_progress() -> None:
        if progress is not None:
            errors = sum(totals.errors.values())
            progress(totals.done, requests, time.perf_counter() - started, totals.tokens, errors)

    async with AsyncClient(target, tls=tls, token=token, timeout=timeout, retry=retry) as client:

        async def worker() -> None:
            while True:
                if requests is not None and totals.issued >= requests:
                    return
                if duration is not None and time.perf_counter() - started >= duration:
                    return
                prompt = prompts[totals.issued % len(prompts)]
                totals.issued += 1
                await _one_request(client, prompt, chat, params, totals)
                totals.done += 1
                report_progress()

        workers = concurrency if requests is None else min(concurrency, requests)
        await asyncio.gather(*(worker() for _ in range(workers)))
        elapsed = time.perf_counter() - started
        resolved_target = client.target

    return BenchReport(
        target=resolved_target,
        concurrency=concurrency,
        max_new_tokens=max_new_tokens,
        requests=totals.done,
        succeeded=totals.succeeded,
        failed=totals.done - totals.succeeded,
        duration_s=elapsed,
        output_tokens=totals.tokens,
        output_tokens_per_s=totals.tokens / elapsed if elapsed > 0 else 0.0,
        requests_per_s=totals.done / elapsed if elapsed > 0 else 0.0,
        ttft_ms=LatencySummary.of(totals.ttft),
        itl_ms=LatencySummary.of(totals.itl),
        e2e_ms=LatencySummary.of(totals.e2e),
        errors=dict(totals.errors),
    )


def run_bench(
    target: str | Sequence[str],
    concurrency: int = 4,
    requests: int | None = None,
    max_new_tokens: int = 64,
    *,
    duration: float | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    chat: bool = True,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    tls: bool | TLSConfig = False,
    token: str | None = None,
    timeout: float | None = None,
    retry: RetryPolicy = NO_RETRY,
    progress: ProgressCallback | None = None,
) -> BenchReport:
    """``run_bench_async`` in its own event loop, for callers that have none."""
    return asyncio.run(
        run_bench_async(
            target,
            concurrency,
            requests,
            max_new_tokens,
            duration=duration,
            prompts=prompts,
            chat=chat,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            tls=tls,
            token=token,
            timeout=timeout,
            retry=retry,
            progress=progress,
        )
    )
