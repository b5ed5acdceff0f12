"""Events from engine threads to the event loop: one hand-off per step (#38 item 5).

- ``handoff.gathered()`` holds a thread's events and hands each loop its share in one
  ``call_soon_threadsafe``, in the order sent; outside it an event crosses at once;
- through the real bridge (``ThreadedSubmission``) the batched engine, plain and overlapped,
  hands a step's events for all its streams over in one call, and each stream reads the same
  events as a direct sink gets; the simple engine's streams read theirs too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import Recorder
from tokenwire_server import handoff
from tokenwire_server.backend import ThreadedSubmission
from tokenwire_server.domain import Event, FinishEvent, GenerationRequest, SamplingOptions, TextEvent
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import Engine, EngineLimits
from tokenwire_server.model import LoadedModel, load_model

pytestmark = pytest.mark.timeout(300)


class CountingLoop:
    """Stands for an event loop: counts the calls, runs each at once."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.calls += 1
        callback(*args)


def test_gathered_events_cross_once_per_loop_in_order() -> None:
    first, second = CountingLoop(), CountingLoop()
    seen: list[tuple[str, int]] = []
    with handoff.gathered():
        for i in range(5):
            handoff.send(first, lambda e: seen.append(("a", e)), i)  # type: ignore[arg-type]
            with handoff.gathered():  # nested: the outermost hands over
                handoff.send(second, lambda e: seen.append(("b", e)), i)  # type: ignore[arg-type]
        assert seen == [] and first.calls == 0
    assert (first.calls, second.calls) == (1, 1)
    assert [e for k, e in seen if k == "a"] == list(range(5)) and [e for k, e in seen if k == "b"] == list(range(5))
    handoff.send(first, lambda e: seen.append(("a", e)), 9)  # type: ignore[arg-type]
    assert first.calls == 2 and seen[-1] == ("a", 9)  # outside a block: at once


def test_a_block_that_raises_still_hands_its_events_over() -> None:
    loop = CountingLoop()
    seen: list[int] = []
    with pytest.raises(ValueError), handoff.gathered():
        handoff.send(loop, seen.append, 1)  # type: ignore[arg-type]
        raise ValueError
    assert seen == [1] and loop.calls == 1


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def start(loaded: LoadedModel, kind: str, **options: Any) -> Engine:
    limits = EngineLimits(4, 8, 4096)
    if kind == "simple":
        engine = create_engine("simple", loaded, limits, workers=2)
    else:
        from tokenwire_server.engine.options import EngineOptions

        # No prefix cache: the second run reads its prompts as the first did (the same steps).
        engine = create_engine("batched", loaded, limits, options=EngineOptions(prefix_cache=False, **options))
    engine.start()
    return engine


def requests(loaded: LoadedModel) -> list[GenerationRequest]:
    tokenizer = loaded.tokenizer
    texts = ["Hello there", "中文：我爱自然语言处理", "Emoji 👋🏽 🧑‍🚀", "The quick brown fox"]
    return [
        GenerationRequest(
            f"r{i}",
            tokenizer(text)["input_ids"],
            SamplingOptions(temperature=0.0),
            12 + i,
            ignore_eos=True,
            want_tokens=i % 2 == 0,
        )
        for i, text in enumerate(texts)
    ]


def read_all(loop: asyncio.AbstractEventLoop, submissions: list[ThreadedSubmission]) -> list[list[Event]]:
    async def read(submission: ThreadedSubmission) -> list[Event]:
        return [event async for event in submission]

    async def every() -> list[list[Event]]:
        return list(await asyncio.gather(*(read(s) for s in submissions)))

    return asyncio.run_coroutine_threadsafe(every(), loop).result(120)


def shape(events: list[Event]) -> list[tuple[Any, ...]]:
    """What a reader sees of a stream: each event's kind, text and token ids, and the finish reason."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        assert isinstance(event, TextEvent | FinishEvent)
        reason = event.reason if isinstance(event, FinishEvent) else None
        out.append((type(event).__name__, event.text, tuple(t.id for t in event.tokens), reason))
    return out


@pytest.mark.parametrize(
    ("kind", "options"),
    [("batched", {"overlap": "off"}), ("batched", {"overlap": "on"}), ("simple", {})],
    ids=["batched", "batched-overlap", "simple"],
)
def test_the_bridge_reads_every_stream_as_a_direct_sink_gets_it(
    loaded: LoadedModel, loop: asyncio.AbstractEventLoop, kind: str, options: dict[str, Any]
) -> None:
    reqs = requests(loaded)
    engine = start(loaded, kind, **options)
    try:
        recorders = [Recorder() for _ in reqs]
        for req, rec in zip(reqs, recorders, strict=True):
            engine.submit(req, rec)
        for rec in recorders:
            assert rec.done.wait(120)
        calls = 0
        count = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return count(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        before = getattr(engine, "steps", 0) + getattr(engine, "prefill_steps", 0)
        submissions = []
        for req in requests(loaded):
            submission = ThreadedSubmission(loop)
            submission.handle = engine.submit(req, submission.sink, submission)
            submissions.append(submission)
        read = read_all(loop, submissions)
        steps = getattr(engine, "steps", 0) + getattr(engine, "prefill_steps", 0) - before
    finally:
        engine.close()
    assert [shape(events) for events in read] == [shape(rec.events) for rec in recorders]
    sent = sum(len(events) for events in read)
    if kind == "batched":
        # At most one hand-off per step, and one per stream that ends on its token as the
        # overlapped loop takes it (before the launch); the read itself is one call.
        assert calls <= steps + len(reqs) + 1 < sent
    else:
        assert calls >= sent  # the simple engine sends each token's event at once
