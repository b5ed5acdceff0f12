"""Slots, measured inside the batched engine: a cancelled stream gives its slot back within
two decode steps, and a request that waited past its deadline is refused, never started."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import engine_support
import pytest
from tokenwire_server.domain import (
    ErrorEvent,
    ErrorKind,
    FinishEvent,
    GenerationRequest,
    SamplingOptions,
    TextEvent,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import LoadedModel, load_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


@pytest.fixture
def engine(loaded: LoadedModel) -> Iterator[object]:
    engine = create_engine("batched", loaded, EngineLimits(max_active=1, max_queue=1, kv_cache_tokens=4096), 1)
    engine.start()
    yield engine
    engine.close()


class Recorder(engine_support.Recorder):
    """The engine tests' recorder, plus ``first_text``: set at the first streamed text."""

    def __init__(self) -> None:
        super().__init__()
        self.first_text = threading.Event()

    def __call__(self, event: object) -> None:
        super().__call__(event)
        if isinstance(event, TextEvent):
            self.first_text.set()


def request(request_id: str, tokens: int, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id, [1, 2, 3], SamplingOptions(temperature=0.0), max_new_tokens=tokens, ignore_eos=True, deadline=deadline
    )


def test_cancel_frees_the_slot_within_two_decode_steps(engine: object) -> None:
    for attempt in range(3):
        sink = Recorder()
        handle = engine.submit(request(f"long-{attempt}", 1000), sink)  # type: ignore[attr-defined]
        assert sink.first_text.wait(10)
        time.sleep(0.05)  # mid-stream
        steps_at_cancel = engine.steps  # type: ignore[attr-defined]
        handle.cancel()
        deadline = time.monotonic() + 5
        while engine.queue.active and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.0005)
        assert engine.queue.active == 0  # type: ignore[attr-defined]
        assert engine.steps - steps_at_cancel <= 2  # type: ignore[attr-defined]
        assert engine.stats().batch_size == 0  # type: ignore[attr-defined]
        assert not sink.done.is_set()  # a cancelled request ends silently: nobody listens
        assert handle.done.is_set()


def test_request_queued_past_its_deadline_is_refused_not_started(engine: object) -> None:
    busy = Recorder()
    busy_handle = engine.submit(request("busy", 1000), busy)  # type: ignore[attr-defined]
    assert busy.first_text.wait(10)
    late = Recorder()
    engine.submit(request("late", 50, deadline=time.monotonic() + 0.2), late)  # type: ignore[attr-defined]
    assert engine.queue.queued == 1  # type: ignore[attr-defined]
    time.sleep(0.4)  # its deadline passes while the only slot is busy
    busy_handle.cancel()  # the slot frees; the engine now looks at the queue
    assert late.done.wait(5)
    assert len(late.events) == 1 and isinstance(late.events[0], ErrorEvent)
    assert late.events[0].kind is ErrorKind.DEADLINE
    # and the engine serves the next one normally
    after = Recorder()
    engine.submit(request("after", 5), after)  # type: ignore[attr-defined]
    assert after.done.wait(10)
    assert isinstance(after.events[-1], FinishEvent)
