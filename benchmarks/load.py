"""The load generators, every latency taken at the client: ``grpc_load`` (a closed loop of
streams over tokenwire's gRPC API, each asking for exactly ``max_new_tokens``: the client's
``run_bench``), ``stream``/``streams`` (raw ``GenerateRequest``s read to their end, for suites
that build their own) and ``openai_load`` (the same closed loop over an OpenAI-style SSE
endpoint, stdlib HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.stats import ms


@dataclasses.dataclass
class Measure:
    """One run of one system at one concurrency; latencies in ms, None where not measured."""

    system: str
    concurrency: int
    requests: int
    tokens: int
    tokens_per_s: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    repeat: int = 0
    rss_mb: float | None = None  # the server's processes together, after the run
    cpu_s: float | None = None  # CPU seconds the server's processes used during the run
    mode: str = "greedy"  # how its requests chose tokens: greedy, or sampled (a suite's own sampling settings)

    @classmethod
    def of(
        cls, system: str, concurrency: int, requests: int, tokens: int, seconds: float, ttft: Sequence[float],
        itl: Sequence[float], e2e: Sequence[float] = (), errors: dict[str, int] | None = None, repeat: int = 0,
    ) -> Measure:  # fmt: skip
        """From the raw seconds."""
        return cls(system, concurrency, requests, tokens, tokens / seconds if seconds > 0 else 0.0,
                   ms(ttft, 50), ms(ttft, 99), ms(itl, 50), ms(itl, 99), ms(e2e, 50), ms(e2e, 99),
                   errors or {}, repeat)  # fmt: skip


def grpc_load(
    target: str, system: str, concurrency: int, requests: int, max_new: int, prompts: Sequence[str] | None = None,
    repeat: int = 0, **options: Any,
) -> Measure:  # fmt: skip
    """The client's ``run_bench`` (``options``: its sampling keywords), as a ``Measure``."""
    import tokenwire.bench

    r = tokenwire.bench.run_bench(target, concurrency=concurrency, requests=requests, max_new_tokens=max_new,
                                  prompts=prompts or tokenwire.bench.DEFAULT_PROMPTS, timeout=3600,
                                  **options)  # fmt: skip
    return Measure(system, concurrency, r.requests, r.output_tokens, r.output_tokens_per_s, r.ttft_ms.p50,
                   r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p99, r.e2e_ms.p50, r.e2e_ms.p99, r.errors, repeat)  # fmt: skip


def warm(target: str) -> None:
    """One short request, so that lazy initialisation is not counted."""
    import tokenwire.bench

    tokenwire.bench.run_bench(target, concurrency=1, requests=1, max_new_tokens=4)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt`` as one user message, chat-templated, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@dataclasses.dataclass
class Stream:
    """One call read to its end: seconds to the first chunk and in all, and its chunks."""

    ttft: float
    seconds: float
    chunks: list[Any]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def ids(self) -> list[int]:
        return [t.id for c in self.chunks for t in c.tokens]

    @property
    def usage(self) -> Any:
        return self.chunks[-1].usage


def stub(channel: Any) -> Any:
    """A TextGeneration stub on ``channel``, or on a new channel to ``channel`` where it is an address."""
    import grpc
    from tokenwire.v1 import generation_pb2_grpc as pb_grpc

    return pb_grpc.TextGenerationStub(grpc.insecure_channel(channel) if isinstance(channel, str) else channel)


def stream(stub: Any, request: Any, timeout: float = 1800, metadata: Sequence[tuple[str, str]] = ()) -> Stream:
    start, first, chunks = time.perf_counter(), None, []
    for chunk in stub.Generate(request, timeout=timeout, metadata=metadata):
        first = time.perf_counter() - start if first is None else first
        chunks.append(chunk)
    assert first is not None, "a stream of no chunks"
    return Stream(first, time.perf_counter() - start, chunks)


def streams(stub: Any, requests: Sequence[Any], concurrency: int, timeout: float = 1800) -> tuple[float, list[Stream]]:
    """``requests`` on ``concurrency`` threads, in order: (wall seconds, their streams)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(lambda r: stream(stub, r, timeout), requests))
    return time.perf_counter() - start, out


async def openai_stream(port: int, body: dict[str, Any]) -> tuple[float | None, list[float], int, int]:
    """One streamed chat completion: (TTFT s, gaps between token events s, completion
    tokens, prompt tokens)."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.perf_counter()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        writer.close()
        raise RuntimeError(f"HTTP {status!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    first: float | None = None
    last, gaps, buffer = 0.0, [], b""
    counts = {"completion": 0, "prompt": 0, "events": 0}

    def events(data: bytes) -> None:
        nonlocal buffer, first, last
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            now = time.perf_counter()
            record = json.loads(event[6:])
            if usage := record.get("usage"):
                counts["completion"], counts["prompt"] = usage["completion_tokens"], usage["prompt_tokens"]
            if not record.get("choices"):
                continue
            choice = record["choices"][0]
            if not choice.get("delta") and choice.get("finish_reason"):
                continue  # the end announced in an event of its own (llama-server's): no token came with it
            # One event per token step; an event whose text the detokenizer holds back
            # (half a character) still marks a token's arrival.
            if first is None:
                if not choice.get("delta", {}).get("content"):
                    continue
                first = last = now
            else:
                gaps.append(now - last)
                last = now
            counts["events"] += 1

    if chunked:
        while size_line := await reader.readline():
            size = int(size_line.strip().split(b";")[0], 16)
            if size == 0:
                break
            events(await reader.readexactly(size))
            await reader.readexactly(2)
    else:
        while data := await reader.read(65536):
            events(data)
    writer.close()
    # A server that sends no usage (llama-cpp-python's stream, before llama-server): one event per token.
    ttft = first - started if first is not None else None
    return ttft, gaps, counts["completion"] or counts["events"], counts["prompt"]


def openai_load(
    port: int, system: str, concurrency: int, requests: int, max_new: int, prompts: Sequence[str],
    extra: dict[str, Any] | None = None, repeat: int = 0, on_prompt: Callable[[str, int], None] | None = None,
) -> Measure:  # fmt: skip
    """``grpc_load``'s closed loop over SSE; ``on_prompt(prompt, prompt tokens)`` for each answer."""
    ttft: list[float] = []
    itl: list[float] = []
    totals = {"tokens": 0, "errors": 0, "issued": 0}

    async def worker() -> None:
        while totals["issued"] < requests:
            prompt = prompts[totals["issued"] % len(prompts)]
            totals["issued"] += 1
            body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    **(extra or {})}  # fmt: skip
            try:
                first, gaps, completion, prompt_count = await openai_stream(port, body)
            except (OSError, RuntimeError, ValueError):
                totals["errors"] += 1
                continue
            totals["tokens"] += completion
            if on_prompt is not None:
                on_prompt(prompt, prompt_count)
            ttft.extend([first] if first is not None else [])
            itl.extend(gaps)

    async def run() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
        return time.perf_counter() - started

    seconds = asyncio.run(run())
    errors = {"error": totals["errors"]} if totals["errors"] else {}
    return Measure.of(system, concurrency, requests, totals["tokens"], seconds, ttft, itl, errors=errors, repeat=repeat)
