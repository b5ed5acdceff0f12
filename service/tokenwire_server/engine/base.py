"""The engine interface and its admission queue.

An engine takes plain ``GenerationRequest`` objects and sends plain events to a
sink; it knows nothing of protobuf or gRPC. Admission is bounded: at most
``max_active`` requests generate at once and at most ``max_queue`` wait; past
that, ``submit`` raises ``EngineOverloaded`` at once, before any work.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from ..domain import (
    EngineClosed,
    EngineFaulted,
    EngineObserver,
    EngineOverloaded,
    EngineStats,
    ErrorKind,
    EventSink,
    GenerationRequest,
    NoObserver,
    RequestHandle,
)
from ..model import LoadedModel
from ..structured import Grammars
from ..text import SharedTokenizer
from .estimate import StartEstimator
from .faults import FAILED_STEPS_FAULT, Fault, classify, describe
from .generation import Generation

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_active: int
    max_queue: int
    kv_cache_tokens: int
    retry_after_s: float = 0.5
    max_prefill_tokens: int = 20
    batch_window_s: float = 0.01


class AdmissionQueue:
    """Requests waiting for a slot, bounded; the engine's own thread(s) take from it."""

    def __init__(self, limits: EngineLimits) -> None:
        self._limits = limits
        self._waiting: collections.deque[Generation] = collections.deque()
        self._active = 0
        self._closed = False
        self._refusal: EngineClosed = EngineClosed("the engine is shutting down")
        self._cond = threading.Condition()

    def put(self, seq: Generation, check: Callable[[int], None] | None = None) -> None:
        """Queue ``seq``, or raise: EngineClosed, EngineOverloaded when full, or whatever
        ``check(queued_ahead)`` raises once there is room (deadline-aware admission)."""
        with self._cond:
            if self._closed:
                raise self._refusal
            limits = self._limits
            if self._active + len(self._waiting) >= limits.max_active + limits.max_queue:
                raise EngineOverloaded(
                    f"server is full: {self._active} active and {len(self._waiting)} queued requests "
                    f"(limits {limits.max_active} + {limits.max_queue}); retry later or on another replica",
                    limits.retry_after_s,
                )
            if check is not None:
                check(len(self._waiting))
            self._waiting.append(seq)
            self._cond.notify()

    def take(self, fits: Callable[[Generation], bool], block: bool, max_count: int) -> list[Generation]:
        """Move waiting sequences that ``fits`` accepts (in arrival order) to active.

        Stops at the first one that does not fit, so a large request is not starved
        by a stream of small ones. Blocks until there is one when ``block`` is set.
        """
        with self._cond:
            if block:
                while not self._waiting and not self._closed:
                    self._cond.wait(timeout=0.5)
            taken: list[Generation] = []
            while self._waiting and len(taken) < max_count:
                seq = self._waiting[0]
                if seq.handle.cancelled:  # gone before it started: drop it quietly
                    self._waiting.popleft()
                    seq.abandon()
                    continue
                if seq.expired(time.monotonic()) is ErrorKind.DEADLINE:  # waited past its deadline
                    self._waiting.popleft()
                    seq.fail(ErrorKind.DEADLINE, "the call's deadline passed while it waited for a slot")
                    continue
                if not fits(seq):
                    break
                self._waiting.popleft()
                taken.append(seq)
            self._active += len(taken)
            return taken

    def wait_for_arrival(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a request to be waiting; True when one is."""
        with self._cond:
            if not self._waiting and not self._closed:
                self._cond.wait(timeout=timeout_s)
            return bool(self._waiting)

    def release(self, count: int = 1) -> None:
        with self._cond:
            self._active -= count
            self._cond.notify()

    def drain_waiting(self) -> list[Generation]:
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
            return waiting

    def close(self, refusal: EngineClosed | None = None) -> None:
        """Admit nothing more; ``refusal`` is what ``put`` raises from now on."""
        with self._cond:
            self._closed = True
            if refusal is not None:
                self._refusal = refusal
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active(self) -> int:
        return self._active

    @property
    def queued(self) -> int:
        return len(self._waiting)


class _Observers:
    """The engine's observer (the metrics) and its own start estimator, both told of every step."""

    def __init__(self, outer: EngineObserver, estimator: StartEstimator) -> None:
        self._outer = outer
        self._estimator = estimator

    def admitted(self, queue_wait_s: float) -> None:
        self._outer.admitted(queue_wait_s)

    def prefill_step(self, seconds: float, tokens: int = 0) -> None:
        self._outer.prefill_step(seconds, tokens)
        self._estimator.prefill(tokens, seconds)

    def decode_step(self, seconds: float) -> None:
        self._outer.decode_step(seconds)
        self._estimator.decode_step(seconds)


class Engine(abc.ABC):
    """Generates tokens for many requests; one implementation per strategy."""

    name: str = ""

    def __init__(self, loaded: LoadedModel, limits: EngineLimits, observer: EngineObserver | None = None) -> None:
        self.loaded = loaded
        self.limits = limits
        self.estimator = StartEstimator()
        self.observer: EngineObserver = _Observers(observer or NoObserver(), self.estimator)
        self.queue = AdmissionQueue(limits)
        self.last_progress = time.monotonic()
        self.fault: str | None = None  # why the device cannot go on (engine.faults); None while it can
        self._failed_steps = 0  # steps in a row that failed, none working between
        # Engine threads decode token text; each gets its own tokenizer (the Rust tokenizer
        # is not safe to share between threads: "Already borrowed").
        self.tokenizer = SharedTokenizer(loaded.tokenizer)
        # Response formats compiled for this vocabulary (constrained decoding), cached by content.
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    def submit(self, request: GenerationRequest, sink: EventSink) -> RequestHandle:
        """Queue a request; raise EngineOverloaded or EngineClosed when it cannot be taken."""
        handle = RequestHandle()
        loaded = self.loaded
        fmt = request.response_format
        constraint = self.grammars.constraint(fmt) if fmt is not None else None  # compiled already: a cache hit
        seq = Generation(request, handle, sink, self.tokenizer, loaded.eos_token_ids, loaded.device, constraint)
        if seq.ended_at_cut is not None:  # a resume whose tokens already ended the stream: say how
            seq.finish(seq.ended_at_cut)
            return handle
        check = (lambda ahead: self._refuse_if_late(request, ahead)) if request.deadline is not None else None
        self.queue.put(seq, check)
        return handle

    def running(self) -> list[tuple[GenerationRequest, int]]:
        """The requests generating now, each with the tokens it has generated (for estimates)."""
        return []

    def _refuse_if_late(self, request: GenerationRequest, queued_ahead: int) -> None:
        """Deadline-aware admission: refuse at once what cannot start before its deadline."""
        assert request.deadline is not None
        estimate = self.estimator.earliest_first_token_s(
            len(request.prompt_ids) + len(request.resume_ids), self.running(), queued_ahead, self.limits.max_active
        )
        left = request.deadline - time.monotonic()
        if left <= 0:
            return  # already past: the queue fails it as DEADLINE_EXCEEDED, the true outcome
        if estimate is not None and estimate > left:
            raise EngineOverloaded(
                f"this request cannot start before its deadline: its first token would come in {estimate:.2f} s "
                f"at the earliest and {max(left, 0):.2f} s remain; retry on another replica",
                self.limits.retry_after_s,
                deadline=True,
            )

    def stats(self) -> EngineStats:
        return EngineStats(self.queue.active, self.queue.queued, self.queue.active, 0, self.limits.kv_cache_tokens)

    def stalled(self, timeout_s: float, now: float | None = None) -> bool:
        """True when work is pending but the engine has made no progress for ``timeout_s``."""
        now = time.monotonic() if now is None else now
        busy = self.queue.active > 0 or self.queue.queued > 0
        return busy and now - self.last_progress > timeout_s

    def _admit(self, seqs: list[Generation], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if seqs and self.queue.active <= len(seqs):
            self._mark_progress()  # work starts on an idle engine: the stall clock starts now
        for seq in seqs:
            seq.admit(now)
            self.observer.admitted(now - seq.request.arrival)

    def _mark_progress(self) -> None:
        self.last_progress = time.monotonic()

    def _step_worked(self) -> None:
        """A step (or, on the simple engine, a request) ran to its end: the engine moves."""
        self._failed_steps = 0
        self._mark_progress()

    def _step_failed(self, seqs: list[Generation], exc: BaseException) -> None:
        """End ``seqs`` for a step that raised ``exc`` (engine.faults says how)."""
        kind = classify(exc)
        if kind is Fault.OUT_OF_MEMORY:
            self._free_device_memory()
            for seq in seqs:
                seq.fail(ErrorKind.OUT_OF_MEMORY, "the device ran out of memory during generation")
            return
        if kind is Fault.STEP:
            self._failed_steps += 1
            log.error("engine step failed", exc_info=exc, extra={"failed_in_a_row": self._failed_steps})
            for seq in seqs:
                seq.fail(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
            if self._failed_steps < FAILED_STEPS_FAULT:
                return
            self._enter_fault(f"{self._failed_steps} engine steps in a row failed, the last with {describe(exc)}")
            return
        log.error("device error in an engine step", exc_info=exc)
        self._enter_fault(f"device error: {describe(exc)}")
        for seq in seqs:
            seq.fail(ErrorKind.INTERNAL, self._fault_message())

    def _free_device_memory(self) -> None:
        """After an out-of-memory error: hand the allocator's cached blocks back to the device."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _enter_fault(self, reason: str) -> None:
        """The device cannot go on: refuse new work, fail what waits, and say so (liveness)."""
        if self.fault is not None:
            return
        self.fault = reason
        log.error("engine faulted; liveness NOT_SERVING until the process restarts", extra={"reason": reason})
        self.queue.close(EngineFaulted(f"this server's engine faulted ({reason})"))
        for seq in self.queue.drain_waiting():
            seq.fail(ErrorKind.INTERNAL, self._fault_message())

    def _fault_message(self) -> str:
        return f"the server's device failed and it must restart ({self.fault}); retry on another replica"

    def failure(self) -> str | None:
        """Why this engine can do no more work (a device fault), or None."""
        return self.fault

    def _fail_waiting(self) -> None:
        for seq in self.queue.drain_waiting():
            seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request started")

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new work, end what runs, and join the engine's threads."""
