"""A stream whose reader stops reading (issue 36, item 7), inside the engines.

A request's sink here is a ``HeldReader``: the engine sends events to it as it always does,
and they count as unread until the test reads them (as gRPC's ``yield`` holds the transport
while a client's window is full). The batched and simple engines:

- park a stream whose reader leaves ``stream_backlog`` events unread: it stops decoding, and
  its slot (and KV blocks) go to others: a request the full server would have refused is
  admitted and finishes while it is parked, and the parked stream holds no queue place;
- resume it once its reader has caught up, with exactly the tokens of an unparked run,
  greedy and seeded-sampled, parked many times over;
- end it STALLED_READER (ABORTED) when its reader reads nothing for the stall timeout, on an
  idle engine too, counted by the observer; keep at most ``max_active + max_queue`` parked;
- drop a parked stream whose caller cancels, at once (``ThreadedSubmission`` wakes the engine).

Each premise is a count the test waits for (the reader holds every event until read), never
a guess at the engine's pace; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from engine_support import Recorder
from tokenwire_server.backend import ThreadedSubmission
from tokenwire_server.domain import (
    EngineOverloaded,
    ErrorEvent,
    ErrorKind,
    FinishEvent,
    GenerationRequest,
    NoObserver,
    SamplingOptions,
)
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import Engine, EngineLimits
from tokenwire_server.model import LoadedModel, load_model
from tokenwire_server.transport.status import from_error

pytestmark = pytest.mark.timeout(300)

BACKLOG = 8  # events a reader may leave unread before its stream is parked
WAIT_S = 60.0  # bound of every wait for the engine (a loaded 2-core host is slow, never this slow)

GREEDY = SamplingOptions(temperature=0.0)
SEEDED = SamplingOptions(temperature=0.9, top_p=0.95, seed=4321)


class HeldReader(Recorder):
    """A sink whose events stay unread until ``read()``: the request's ``StreamReader`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0
        self._last = time.monotonic()
        self._wake: tuple[int, Callable[[], None]] | None = None
        self._lock = threading.Lock()

    # StreamReader
    def unread(self) -> int:
        return len(self.events) - self.taken

    def last_read(self) -> float:
        return self._last

    def wake_when_read(self, down_to: int, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wake = (down_to, wake)
        self._maybe_wake()

    def _maybe_wake(self) -> None:
        with self._lock:
            waiting = self._wake
            if waiting is None or self.unread() > waiting[0]:
                return
            self._wake = None
        waiting[1]()

    # the test's side
    def read(self) -> None:
        """Take every event sent so far."""
        self.taken = len(self.events)
        self._last = time.monotonic()
        self._maybe_wake()

    def read_to_end(self, parked: Callable[[], int] | None = None, timeout: float = WAIT_S) -> None:
        """Read until the stream ends: every 5 ms, or (``parked``) each time the stream is
        parked again, so that it is parked and resumed over and over."""
        deadline = time.monotonic() + timeout
        while not self.done.is_set():
            assert time.monotonic() < deadline, "the stream did not end while read"
            self.read()
            if parked is None:
                time.sleep(0.005)
            else:
                assert wait_for(lambda: parked() > 0 or self.done.is_set(), timeout)
        self.read()


class Counts(NoObserver):
    def __init__(self) -> None:
        self.parks: list[str] = []
        self.stalled: list[str] = []

    def parked(self, tenant: str) -> None:
        self.parks.append(tenant)

    def reader_stalled(self, tenant: str) -> None:
        self.stalled.append(tenant)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


ENGINES = [
    pytest.param("batched", {}, id="batched"),
    pytest.param("batched", {"prefix_cache": False}, id="batched-no-prefix-cache"),
    pytest.param("batched", {"overlap": "on"}, id="batched-overlap"),
    pytest.param("simple", {}, id="simple"),
]


def start(loaded: LoadedModel, kind: str, options: dict[str, Any], observer: Any = None, **limits: Any) -> Engine:
    fields: dict[str, Any] = dict(
        max_active=1, max_queue=0, kv_cache_tokens=4096, stream_backlog=BACKLOG, stalled_reader_timeout_s=0.0
    )
    fields.update(limits)
    engine_limits = EngineLimits(**fields)
    if kind == "simple":
        engine = create_engine("simple", loaded, engine_limits, workers=engine_limits.max_active, observer=observer)
    else:
        engine = create_engine("batched", loaded, engine_limits, workers=1, observer=observer, **options)
    engine.start()
    return engine


@pytest.fixture
def engines(loaded: LoadedModel) -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def make(kind: str, options: dict[str, Any], observer: Any = None, **limits: Any) -> Engine:
        engine = start(loaded, kind, options, observer, **limits)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.close()


def request(
    rid: str, tokens: int, sampling: SamplingOptions = GREEDY, prompt: tuple[int, ...] = (1, 2, 3, 4, 5)
) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), sampling, max_new_tokens=tokens, ignore_eos=True, want_tokens=True)


def wait_for(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def alone(engine: Engine, req: GenerationRequest) -> list[int]:
    """``req``'s tokens with a reader that takes everything as it comes (never parked)."""
    rec = Recorder()
    engine.submit(req, rec)
    assert rec.done.wait(WAIT_S)
    assert isinstance(rec.last, FinishEvent), rec.last
    assert wait_for(lambda: engine.queue.active == 0)  # its slot given back (just after its last event)
    return rec.token_ids


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("kind", "options"), ENGINES)
def test_an_unread_stream_gives_its_slot_up_and_resumes_with_the_same_tokens(
    engines: Callable[..., Engine], kind: str, options: dict[str, Any], sampling: SamplingOptions
) -> None:
    """One slot and no queue: with the old code the unread stream kept the slot and the server
    refused the second caller (RESOURCE_EXHAUSTED). Here the stream is parked once its reader
    leaves BACKLOG events unread; the second caller is admitted, runs and finishes meanwhile;
    then the stream is read, parked and resumed again and again, and its tokens are those of
    the same request run unparked."""
    counts = Counts()
    engine = engines(kind, options, counts)
    unread = request("unread", 120, sampling)
    expected = alone(engine, unread)

    held = HeldReader()
    handle = engine.submit(unread, held, held)
    assert wait_for(lambda: engine.queue.parked == 1), "the unread stream was not parked"
    sent = len(held.events)
    assert BACKLOG <= sent <= BACKLOG + 2  # it stopped decoding (one more with a step in flight)
    assert engine.queue.active == 0 and engine.queue.queued == 0  # no slot, no queue place
    assert engine.stats().parked == 1

    other = Recorder()
    engine.submit(request("other", 12, prompt=(9, 8, 7)), other)  # the full old server refused it here
    assert other.done.wait(WAIT_S) and isinstance(other.last, FinishEvent)
    assert other.last.usage.completion_tokens == 12
    assert len(held.events) == sent and engine.queue.parked == 1  # still parked: nothing was read

    held.read_to_end(parked=lambda: engine.queue.parked)
    assert isinstance(held.last, FinishEvent), held.last
    assert held.token_ids == expected
    assert held.last.usage.completion_tokens == 120
    assert handle.done.is_set()
    parks = len(counts.parks)
    assert parks >= 120 // BACKLOG // 2, parks  # parked again and again as the reader fell behind, resumed each time
    assert engine.queue.parked == 0
    assert wait_for(lambda: engine.queue.active == 0 and engine.stats().batch_size == 0, 5)  # just after its last event


def test_a_parked_stream_holds_no_queue_place_and_the_first_token_estimate_ignores_it(
    engines: Callable[..., Engine],
) -> None:
    """A deadline caller is refused when its first token cannot come in time; a parked stream
    must not count as a running one ahead of it (issue: 85-93 s estimated, and refused)."""
    engine = engines("batched", {}, max_active=1, max_queue=2)
    held = HeldReader()
    engine.submit(request("unread", 200), held, held)
    assert wait_for(lambda: engine.queue.parked == 1)
    assert engine.running() == []  # the estimate's running requests: not the parked one
    a, b = HeldReader(), HeldReader()
    engine.submit(request("a", 200, prompt=(3, 3, 3)), a, a)
    engine.submit(request("b", 200, prompt=(4, 4, 4)), b, b)
    assert wait_for(lambda: engine.queue.parked == 3)  # neither reads either
    late = Recorder()
    deadline = time.monotonic() + 30
    engine.submit(GenerationRequest("late", [5, 6], GREEDY, 4, deadline=deadline), late)
    assert late.done.wait(WAIT_S) and isinstance(late.last, FinishEvent)
    for reader in (held, a, b):
        reader.read_to_end()
        assert isinstance(reader.last, FinishEvent)


@pytest.mark.parametrize(("kind", "options"), [ENGINES[0], ENGINES[3]])
def test_a_reader_that_never_comes_back_ends_the_stream_stalled_reader(
    engines: Callable[..., Engine], kind: str, options: dict[str, Any]
) -> None:
    """Parked with nothing read for the stall timeout (the engine idle meanwhile: it waits for
    work, and still ends it), the stream's last event is STALLED_READER, which the transport
    sends as ABORTED; the observer counts it; nothing is left parked."""
    counts = Counts()
    engine = engines(kind, options, counts, stalled_reader_timeout_s=0.5)
    held = HeldReader()
    handle = engine.submit(request("never-read", 500), held, held)
    assert wait_for(lambda: engine.queue.parked == 1)
    parked_at = time.monotonic()
    assert held.done.wait(WAIT_S), "the stalled stream was never ended"
    assert time.monotonic() - parked_at >= 0.4
    last = held.last
    assert isinstance(last, ErrorEvent) and last.kind is ErrorKind.STALLED_READER, last
    assert "stopped reading" in last.message and "--stalled-reader-timeout" in last.message
    assert from_error(last.kind, last.message, 0.5).code is grpc.StatusCode.ABORTED
    assert handle.done.is_set()
    assert counts.stalled == ["default"]
    assert engine.queue.parked == 0 and engine.queue.active == 0 and engine.queue.queued == 0
    assert engine.stats().parked == 0


def test_a_reader_that_reads_slowly_is_not_ended(engines: Callable[..., Engine]) -> None:
    """The stall clock is the time since the reader last read: a reader that takes an event now
    and then, never catching up for long, keeps its stream past the timeout."""
    engine = engines("batched", {}, stalled_reader_timeout_s=1.0)
    held = HeldReader()
    engine.submit(request("slow", 60), held, held)
    assert wait_for(lambda: engine.queue.parked == 1)
    for _ in range(5):  # 1.75 s in all, a read every 0.35 s that leaves it behind
        time.sleep(0.35)
        held.taken = min(held.taken + 1, len(held.events))
        held._last = time.monotonic()
    assert not held.done.is_set()
    held.read_to_end()
    assert isinstance(held.last, FinishEvent) and held.last.usage.completion_tokens == 60


def test_at_most_max_active_plus_max_queue_streams_stay_parked(engines: Callable[..., Engine]) -> None:
    """With no stall timeout, parked streams are still bounded: one past max_active +
    max_queue (here 2) ends the one whose reader has been idle longest."""
    counts = Counts()
    engine = engines("batched", {}, counts, max_active=1, max_queue=1)
    readers = [HeldReader() for _ in range(3)]
    for i, reader in enumerate(readers):
        engine.submit(request(f"unread-{i}", 300, prompt=(i + 1, 2, 3)), reader, reader)
        assert wait_for(lambda i=i: engine.queue.parked == min(i + 1, 2) and len(readers[i].events) >= BACKLOG)
    assert readers[0].done.wait(WAIT_S)
    assert isinstance(readers[0].last, ErrorEvent) and readers[0].last.kind is ErrorKind.STALLED_READER
    assert "more streams wait for their callers than the server keeps (2)" in readers[0].last.message
    assert engine.queue.parked == 2 and counts.stalled == ["default"]
    for reader in readers[1:]:
        reader.read_to_end()
        assert isinstance(reader.last, FinishEvent)


def test_a_parked_stream_whose_caller_cancels_is_dropped_at_once(engines: Callable[..., Engine]) -> None:
    """Through the real bridge (``ThreadedSubmission`` on an event loop, never iterated): the
    stream parks with BACKLOG events queued there, and ``cancel()`` drops it within the same
    moment, not at the stall timeout; the queue holds no more than BACKLOG (+ a step) events."""
    engine = engines("batched", {}, stalled_reader_timeout_s=600.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        submission = ThreadedSubmission(loop)
        submission.handle = engine.submit(request("unread", 500), submission.sink, submission)
        assert wait_for(lambda: engine.queue.parked == 1)
        assert BACKLOG <= submission.unread() <= BACKLOG + 2
        time.sleep(0.2)
        assert BACKLOG <= submission.unread() <= BACKLOG + 2  # bounded: nothing more was decoded
        cancelled = time.monotonic()
        loop.call_soon_threadsafe(submission.cancel)
        assert wait_for(lambda: engine.queue.parked == 0, 3)
        assert time.monotonic() - cancelled < 3
        assert submission.handle.done.is_set()
        assert engine.queue.queued == 0 and engine.queue.active == 0
        with pytest.raises(EngineOverloaded):  # the bounds still hold: one slot, no queue
            engine.submit(request("a", 300), Recorder())
            engine.submit(request("b", 300), Recorder())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_the_flags_have_their_environment_fallbacks_and_bounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenwire_server.config import ServerConfig, parse_config

    assert (ServerConfig().stream_backlog_chunks, ServerConfig().stalled_reader_timeout) == (256, 30.0)
    monkeypatch.setenv("TOKENWIRE_STALLED_READER_TIMEOUT", "0")
    monkeypatch.setenv("TOKENWIRE_STREAM_BACKLOG_CHUNKS", "64")
    config = parse_config([])
    assert (config.stream_backlog_chunks, config.stalled_reader_timeout) == (64, 0.0)
    assert parse_config(["--stream-backlog-chunks", "16"]).stream_backlog_chunks == 16
    for bad, message in (
        (["--stream-backlog-chunks", "0"], "--stream-backlog-chunks must be at least 1"),
        (["--stalled-reader-timeout", "-1"], "--stalled-reader-timeout must not be negative"),
    ):
        with pytest.raises(SystemExit):
            parse_config(bad)
        assert message in capsys.readouterr().err
