"""Slots, measured inside the batched engine: a cancelled stream gives its slot back within
two decode steps (the one place for that, on both kernel choices), a request that waited
past its deadline is refused, never started, and the batch window gathers concurrent
arrivals while a lone stream never waits.

Each premise holds by construction, not by timing: the engine thread calls a request's sink
itself, so a sink that blocks holds the engine between two steps (``Gate``) while the test
reads its counters, cancels, or queues a request behind it."""

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
from tokenwire_server.engine.batched import BatchedEngine
from tokenwire_server.model import LoadedModel, load_model

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


KERNELS = engine_support.kernel_choices()


def start_engine(loaded: LoadedModel, kernels: str | None = None, **limits: float) -> BatchedEngine:
    fields: dict = dict(max_active=1, max_queue=1, kv_cache_tokens=4096)
    fields.update(limits)
    engine = create_engine("batched", loaded, EngineLimits(**fields), 1, **({"kernels": kernels} if kernels else {}))
    assert isinstance(engine, BatchedEngine)
    assert kernels is None or engine.kernels == kernels  # the native pass took what was asked
    engine.start()
    return engine


@pytest.fixture
def engine(loaded: LoadedModel) -> Iterator[BatchedEngine]:
    engine = start_engine(loaded)
    yield engine
    engine.close()


class Gate(engine_support.Recorder):
    """A recorder whose ``at``-th text event holds the engine thread (it runs the sink) until
    ``release()``: between ``held.wait()`` and ``release()`` the engine takes no step."""

    def __init__(self, at: int = 1) -> None:
        super().__init__()
        self.at = at
        self.texts = 0
        self.held = threading.Event()
        self._open = threading.Event()

    def __call__(self, event: object) -> None:
        super().__call__(event)
        if isinstance(event, TextEvent):
            self.texts += 1
            if self.texts == self.at:
                self.held.set()
                assert self._open.wait(30), "the test never released the engine"

    def release(self) -> None:
        self._open.set()


def request(
    request_id: str, tokens: int, deadline: float | None = None, prompt: tuple[int, ...] = (1, 2, 3)
) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        list(prompt),
        SamplingOptions(temperature=0.0),
        max_new_tokens=tokens,
        ignore_eos=True,
        deadline=deadline,
    )


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("kernels", KERNELS)
def test_cancel_frees_the_slot_within_two_decode_steps_and_the_batch_goes_on(
    loaded: LoadedModel, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled from another thread while the engine is held mid-stream, so the step count
    read before ``cancel()`` is the count at the cancel; the scheduler's own ``leave`` records
    the count when the row gives its slot back. A second stream in the same batch runs to
    its end; the cancelled one gets no event after the cancel."""
    engine = start_engine(loaded, kernels, max_active=2, max_queue=0)
    left_at: dict[str, int] = {}
    leave = engine.scheduler.leave

    def spy(rows: list) -> None:
        for row in rows:
            left_at.setdefault(row.seq.request.request_id, engine.steps)
        leave(rows)

    monkeypatch.setattr(engine.scheduler, "leave", spy)
    try:
        for attempt in range(3):
            keep = engine_support.Recorder()
            engine.submit(request(f"keep-{attempt}", 60), keep)
            victim = Gate(at=5)  # mid-stream: four tokens out, 995 to go
            handle = engine.submit(request(f"victim-{attempt}", 1000), victim)
            assert victim.held.wait(10)
            steps_at_cancel = engine.steps
            events_at_cancel = len(victim.events)
            handle.cancel()
            victim.release()
            assert handle.done.wait(5)
            name = f"victim-{attempt}"
            assert wait_for(lambda name=name: name in left_at, 5)
            assert left_at[name] - steps_at_cancel <= 2
            assert len(victim.events) == events_at_cancel  # nothing after the cancel
            assert not victim.done.is_set()  # a cancelled request ends silently: nobody listens
            assert keep.done.wait(30)  # the batch goes on for the other row
            assert isinstance(keep.last, FinishEvent) and keep.last.usage.completion_tokens == 60
            assert wait_for(lambda: engine.queue.active == 0, 5)
            assert engine.stats().batch_size == 0
    finally:
        engine.close()


def test_request_queued_past_its_deadline_is_refused_not_started(engine: BatchedEngine) -> None:
    """The only slot is held (the engine thread waits in the busy stream's sink), so the late
    request queues and its deadline passes before any step could start it. Its deadline
    allows the engine's own estimate of its start plus 0.2 s, so admission takes it
    (deadline-aware admission refuses only what its estimate says cannot start in time)."""
    busy = Gate(at=1)
    busy_handle = engine.submit(request("busy", 1000), busy)
    assert busy.held.wait(10)
    estimate = engine.estimator.earliest_first_token_s(3, engine.running(), 0, engine.limits.max_active) or 0.0
    deadline = time.monotonic() + estimate + 0.2
    late = engine_support.Recorder()
    engine.submit(request("late", 50, deadline=deadline), late)  # admitted: it raises otherwise
    assert engine.queue.queued == 1
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)  # its deadline passes; the slot is still held
    assert engine.queue.queued == 1 and not late.events
    busy_handle.cancel()  # the slot frees; the engine now looks at the queue
    busy.release()
    assert late.done.wait(5)
    assert len(late.events) == 1 and isinstance(late.events[0], ErrorEvent)
    assert late.events[0].kind is ErrorKind.DEADLINE
    assert late.events[0].message == "the call's deadline passed while it waited for a slot"
    # and the engine serves the next one normally
    after = engine_support.Recorder()
    engine.submit(request("after", 5), after)
    assert after.done.wait(10)
    assert isinstance(after.events[-1], FinishEvent)


# -- the batch window (--batch-window-ms) ---------------------------------------------------

WINDOW_S = 30.0  # far longer than anything below takes: a wait of the window cannot hide


def test_a_lone_stream_never_waits_for_the_batch_window(loaded: LoadedModel) -> None:
    """With a 30 s window, a lone request on an idle engine (never busy, or last busy with
    one row) starts at once: it finishes in a small fraction of the window."""
    engine = start_engine(loaded, max_active=4, max_queue=4, batch_window_s=WINDOW_S)
    try:
        for i in range(3):
            lone = engine_support.Recorder()
            engine.submit(request(f"lone-{i}", 4), lone)
            assert lone.done.wait(WINDOW_S / 3), "a lone stream waited for the batch window"
            assert isinstance(lone.last, FinishEvent)
            assert lone.last.usage.queue_time_s < WINDOW_S / 3
    finally:
        engine.close()


def test_after_concurrent_load_the_window_gathers_arrivals_into_one_prefill(loaded: LoadedModel) -> None:
    """After a busy period of two rows, a request arriving at an idle engine waits in the
    window for the next arrival, so both prompts are read in one step. The second is
    submitted only once the engine has taken the first from the queue: without the window
    the first would be prefilled alone, in a step of its own."""
    engine = start_engine(loaded, max_active=2, max_queue=2, batch_window_s=WINDOW_S)
    try:
        two_rows_busy(engine)
        prefills = engine.prefill_steps
        a, b = engine_support.Recorder(), engine_support.Recorder()
        engine.submit(request("a", 4, prompt=(5, 6, 7)), a)
        assert wait_for(lambda: engine.queue.queued == 0, 10)  # taken: the engine waits in the window
        engine.submit(request("b", 4, prompt=(8, 9, 10)), b)
        assert a.done.wait(WINDOW_S / 3) and b.done.wait(WINDOW_S / 3)
        assert engine.prefill_steps - prefills == 1, "the window did not gather the second arrival"
    finally:
        engine.close()


def test_a_zero_batch_window_never_waits(loaded: LoadedModel) -> None:
    """``--batch-window-ms 0``: after the same busy period of two rows, a lone arrival
    starts at once (with the window it would wait for a second one)."""
    engine = start_engine(loaded, max_active=2, max_queue=2, batch_window_s=0.0)
    try:
        two_rows_busy(engine)
        a = engine_support.Recorder()
        engine.submit(request("a", 4), a)
        assert a.done.wait(WINDOW_S / 3)
        assert isinstance(a.last, FinishEvent)
    finally:
        engine.close()


def two_rows_busy(engine: BatchedEngine) -> None:
    """A busy period of two rows, by construction: the first request is held in its sink
    until the second is queued, so the two share the batch. Returns once both have ended."""
    first = Gate(at=1)
    engine.submit(request("busy-a", 8), first)
    assert first.held.wait(10)
    second = engine_support.Recorder()
    engine.submit(request("busy-b", 8), second)
    first.release()
    assert first.done.wait(10) and second.done.wait(10)
    assert wait_for(lambda: engine.queue.active == 0, 5)
