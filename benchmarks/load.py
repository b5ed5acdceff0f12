"""The load generators, every latency taken at the client: ``grpc_load`` (the client's ``run_bench``: a closed
loop of streams over gRPC), ``stream``/``streams`` (raw ``GenerateRequest``s, built by ``request``) and
``openai_load`` (the same closed loop over an OpenAI-style SSE endpoint, stdlib HTTP/1.1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from benchmarks.stats import ms

T = TypeVar("T")


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
        itl: Sequence[float], e2e: Sequence[float] = (), errors: dict[str, int] | None = None,
    ) -> Measure:  # fmt: skip
        return cls(system, concurrency, requests, tokens, tokens / seconds if seconds > 0 else 0.0,
                   ms(ttft, 50), ms(ttft, 99), ms(itl, 50), ms(itl, 99), ms(e2e, 50), ms(e2e, 99),
                   errors or {})  # fmt: skip


def grpc_load(
    target: str, system: str, concurrency: int, requests: int, max_new: int, prompts: Sequence[str] | None = None,
    **options: Any,
) -> Measure:  # fmt: skip
    """The client's ``run_bench`` (``options``: its sampling keywords), as a ``Measure``."""
    import tokenwire.bench

    r = tokenwire.bench.run_bench(target, concurrency=concurrency, requests=requests, max_new_tokens=max_new,
                                  prompts=prompts or tokenwire.bench.DEFAULT_PROMPTS, timeout=3600,
                                  **options)  # fmt: skip
    return Measure(system, concurrency, r.requests, r.output_tokens, r.output_tokens_per_s, r.ttft_ms.p50,
                   r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p99, r.e2e_ms.p50, r.e2e_ms.p99, r.errors)  # fmt: skip


def warm(target: str) -> None:
    """One short request, so that lazy initialisation is not counted."""
    import tokenwire.bench

    tokenwire.bench.run_bench(target, concurrency=1, requests=1, max_new_tokens=4)


def in_thread(work: Callable[[], T]) -> T:
    """``work()`` in a thread that ends once it returns, as the server loads its model: a thread that ran torch
    in parallel and lives on keeps a second OpenMP pool, which slows the engine loop's."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """``prompt`` as one user message, chat-templated, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def request(
    text: str = "", tokens: int = 16, *, chat: bool = False, system: str = "", ignore_eos: bool = False, **fields: Any
) -> Any:
    """A ``GenerateRequest`` for ``tokens`` new tokens: ``text`` as a raw prompt, or with ``chat`` (or a ``system``
    prompt) as a user's message; ``fields``: its other fields (a message field may be a dict)."""
    from tokenwire.v1 import generation_pb2 as pb

    if chat or system:
        messages = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": text}]
        fields["chat"] = {"messages": messages}
    elif text:
        fields["prompt"] = text
    return pb.GenerateRequest(stopping={"max_new_tokens": tokens, "ignore_eos": ignore_eos}, **fields)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """A call's metadata for the bearer ``token``."""
    return (("authorization", f"Bearer {token}"),)


def resumed(request: Any, chunks: Sequence[Any]) -> Any:
    """A copy of ``request`` that resumes it after ``chunks``: their token ids, and the next chunk's index."""
    again = copy.deepcopy(request)
    again.resume.generated_token_ids.extend(t.id for c in chunks for t in c.tokens)
    again.resume.next_index = len(chunks)
    return again


@dataclasses.dataclass
class Stream:
    """One call read to its end (or its cut): seconds to the first chunk (None: none came) and in all, its chunks,
    and the error it ended with (only where ``stream`` was told to ``catch`` it)."""

    ttft: float | None
    seconds: float
    chunks: list[Any]
    error: Any = None

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


def stream(
    stub: Any, request: Any, timeout: float = 1800, metadata: Any = (), cut: int = 0, catch: bool = False
) -> Stream:
    """``request`` read to its end (``metadata``: the call's (key, value) pairs), or cancelled after ``cut``
    chunks; a gRPC error raised, or kept where ``catch``."""
    import grpc

    start, first, chunks, error = time.perf_counter(), None, [], None
    call = stub.Generate(request, timeout=timeout, metadata=metadata)
    try:
        for chunk in call:
            first = time.perf_counter() - start if first is None else first
            chunks.append(chunk)
            if len(chunks) == cut:
                call.cancel()
                break
    except grpc.RpcError as exc:
        if not catch:
            raise
        error = exc
    assert first is not None or catch, "a stream of no chunks"
    return Stream(first, time.perf_counter() - start, chunks, error)


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
    head = f"Host: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\n{head}Connection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    if b" 200 " not in (status := await reader.readline()):
        writer.close()
        raise RuntimeError(f"HTTP {status!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    stamps: list[float] = []  # each token event's arrival
    usage = {"completion_tokens": 0, "prompt_tokens": 0}
    buffer = b""

    def events(data: bytes) -> None:
        nonlocal buffer
        *whole, buffer = (buffer + data).split(b"\n\n")
        for event in whole:
            now = time.perf_counter()
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            record = json.loads(event[6:])
            usage.update(record.get("usage") or {})
            choice = (record.get("choices") or [{}])[0]
            if not choice or (not choice.get("delta") and choice.get("finish_reason")):
                continue  # no choice, or the end announced in an event of its own (llama-server's): no token
            # One event per token step from the first with text on; an event whose text the detokenizer
            # holds back (half a character) still marks a token's arrival.
            if stamps or choice.get("delta", {}).get("content"):
                stamps.append(now)

    if chunked:
        while size := int((await reader.readline()).strip().split(b";")[0] or b"0", 16):
            events(await reader.readexactly(size))
            await reader.readexactly(2)
    else:
        while data := await reader.read(65536):
            events(data)
    writer.close()
    # A server that sends no usage (llama-cpp-python's stream, before llama-server): one event per token.
    ttft = stamps[0] - started if stamps else None
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return ttft, gaps, usage["completion_tokens"] or len(stamps), usage["prompt_tokens"]


def openai_load(
    port: int, system: str, concurrency: int, requests: int, max_new: int, prompts: Sequence[str],
    extra: dict[str, Any] | None = None, on_prompt: Callable[[str, int], None] | None = None,
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
    return Measure.of(system, concurrency, requests, totals["tokens"], seconds, ttft, itl, errors=errors)
