"""The engine interface; its admission queue is ``admission.AdmissionQueue``.

An engine takes plain ``GenerationRequest`` objects and sends plain events to a
sink; it knows nothing of protobuf or gRPC. Admission is bounded: at most
``max_active`` requests generate at once and at most ``max_queue`` wait; past
that, ``submit`` raises ``EngineOverloaded`` at once, before any work.

A stream whose reader falls ``stream_backlog`` events behind is *parked*: it leaves its
slot (and, on the batched engine, its KV blocks) and holds no queue place until the reader
has caught up, then goes back to the front of its tenant's queue like a preempted request,
with the same tokens; parked past ``stalled_reader_timeout_s`` with nothing read, it ends
``STALLED_READER`` (docs/architecture.md, "A reader that falls behind").
"""

from __future__ import annotations

import abc
import logging
import time
from typing import Any

import torch

from ..domain import (
    EngineFaulted,
    EngineObserver,
    EngineOverloaded,
    EngineStats,
    ErrorKind,
    EventSink,
    GenerationRequest,
    NoObserver,
    NotSupported,
    RequestHandle,
    StreamReader,
    UnknownAdapter,
)
from ..model import LoadedModel
from ..structured import Grammars
from ..text import SharedTokenizer
from .admission import AdmissionQueue, EngineLimits, cost_of
from .estimate import StartEstimator
from .faults import FAILED_STEPS_FAULT, Fault, classify, describe
from .generation import Generation

__all__ = ["AdmissionQueue", "Engine", "EngineLimits", "cost_of"]

log = logging.getLogger(__name__)


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

    def step_host(self, seconds: float) -> None:
        self._outer.step_host(seconds)

    def preempted(self, tenant: str) -> None:
        self._outer.preempted(tenant)

    def parked(self, tenant: str) -> None:
        self._outer.parked(tenant)

    def reader_stalled(self, tenant: str) -> None:
        self._outer.reader_stalled(tenant)


class Engine(abc.ABC):
    """Generates tokens for many requests; one implementation per strategy."""

    name: str = ""

    def __init__(self, loaded: LoadedModel, limits: EngineLimits, observer: EngineObserver | None = None) -> None:
        self.loaded = loaded
        self.limits = limits
        # The longest context a request may reach here: the model's, or less where the batched
        # engine's memory-sized KV pool cannot hold a row of it beside its worst step (``memory``).
        self.context_limit = loaded.context_length
        self.estimator = StartEstimator()
        self.observer: EngineObserver = _Observers(observer or NoObserver(), self.estimator)
        self.queue = AdmissionQueue(limits, on_stalled=self._reader_stalled)
        self.last_progress = time.monotonic()
        self.fault: str | None = None  # why the device cannot go on (engine.faults); None while it can
        self._failed_steps = 0  # steps in a row that failed, none working between
        # Engine threads decode token text with the original; a thread that encodes gets its own
        # copy (encoding with a Rust tokenizer from two threads fails: "Already borrowed").
        self.tokenizer = SharedTokenizer(loaded.tokenizer)
        # Response formats compiled for this vocabulary (constrained decoding), cached by content.
        self.grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)

    def submit(self, request: GenerationRequest, sink: EventSink, reader: StreamReader | None = None) -> RequestHandle:
        """Queue a request; raise EngineOverloaded or EngineClosed when it cannot be taken.
        ``reader``: how far behind the caller is in taking ``sink``'s events (flow control;
        None: it takes them as they come)."""
        handle = RequestHandle()
        loaded = self.loaded
        fmt = request.response_format
        constraint = self.grammars.constraint(fmt) if fmt is not None else None  # compiled already: a cache hit
        adapter = self.adapter_of(request)
        seq = Generation(request, handle, sink, self.tokenizer, loaded.eos_token_ids, loaded.device, constraint, reader)
        if adapter is not None:
            seq.adapter, seq.prefix_root = adapter, adapter.root
        if seq.ended_at_cut is not None:  # a resume whose tokens already ended the stream: say how
            seq.finish(seq.ended_at_cut)
            return handle
        check = (lambda ahead: self._refuse_if_late(request, ahead)) if request.deadline is not None else None
        self.queue.put(seq, check)
        return handle

    # -- LoRA adapters: the batched engine applies them; this engine applies none ----------

    def _no_adapters(self) -> NotSupported:
        return NotSupported(
            f"the {self.name} engine does not apply LoRA adapters; serve them with --engine batched or vllm"
        )

    @property
    def applies_adapters(self) -> bool:
        """Whether this engine applies LoRA adapters (ModelDescription.applies_adapters)."""
        return False

    def add_adapter(self, adapter: Any) -> None:
        """Apply ``adapter`` (``adapters.read_adapter``'s) to the requests that name it from now on."""
        raise self._no_adapters()

    def remove_adapter(self, name: str) -> int:
        """Stop new requests from naming ``name``; the streams running with it now."""
        raise UnknownAdapter(name, [])

    def adapter_of(self, request: GenerationRequest) -> Any:
        """The request's LoRA adapter as this engine applies it (None: the base model);
        UnknownAdapter for a name not loaded, NotSupported where the engine applies none."""
        if request.adapter:
            raise self._no_adapters()
        return None

    def adapters(self) -> list[Any]:
        """The LoRA adapters loaded (name, rank, modules)."""
        return []

    def running(self) -> list[tuple[GenerationRequest, int]]:
        """The requests generating now, each with the tokens it has generated (for estimates)."""
        return []

    def _refuse_if_late(self, request: GenerationRequest, queued_ahead: int | None) -> None:
        """Deadline-aware admission: refuse at once what cannot start before its deadline
        (``queued_ahead`` None: it takes a running request's slot at once)."""
        assert request.deadline is not None
        running = self.running() if queued_ahead is not None else []
        estimate = self.estimator.earliest_first_token_s(
            len(request.prompt_ids) + len(request.resume_ids), running, queued_ahead or 0, self.limits.max_active
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
        queue = self.queue
        return EngineStats(
            queue.active,
            queue.queued,
            queue.active,
            0,
            self.limits.kv_cache_tokens,
            tuple(queue.by_tenant()),
            queue.parked,
        )

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
            if seq.admitted_at is None:  # not a preempted request coming back
                self.observer.admitted(now - seq.request.arrival)
            seq.mark_admitted(now)

    def _parked(self, seq: Generation) -> None:
        """``seq`` left its slot for its reader to catch up (``AdmissionQueue.park``)."""
        self.observer.parked(seq.request.tenant)
        log.debug(
            "parked: the reader fell behind",
            extra={"request_id": seq.request.request_id, "generated": len(seq.generated), "parks": seq.parks},
        )

    def _reader_stalled(self, seq: Generation) -> None:
        """``seq`` ended STALLED_READER (called under the queue's lock: report only)."""
        self.observer.reader_stalled(seq.request.tenant)
        log.info(
            "stream ended: its reader stopped reading",
            extra={"request_id": seq.request.request_id, "tenant": seq.request.tenant, "generated": len(seq.generated)},
        )

    def _preempted(self, seq: Generation) -> None:
        self.observer.preempted(seq.request.tenant)
        log.debug(
            "preempted",
            extra={"request_id": seq.request.request_id, "tenant": seq.request.tenant, "generated": len(seq.generated)},
        )

    def _mark_progress(self) -> None:
        self.last_progress = time.monotonic()

    def _step_worked(self) -> None:
        """A step (or, on the simple engine, a request) ran to its end: the engine moves."""
        self._failed_steps = 0
        self._mark_progress()

    def _step_failed(self, seqs: list[Generation], exc: BaseException) -> list[Generation]:
        """End the requests of a step that raised ``exc`` (engine.faults says how), ``seqs``
        in admission order; return those ended (the others go on)."""
        kind = classify(exc)
        if kind is Fault.OUT_OF_MEMORY:
            return self._out_of_memory(seqs)
        if kind is Fault.STEP:
            self._failed_steps += 1
            log.error("engine step failed", exc_info=exc, extra={"failed_in_a_row": self._failed_steps})
            for seq in seqs:
                seq.fail(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
            if self._failed_steps >= FAILED_STEPS_FAULT:
                self._enter_fault(f"{self._failed_steps} engine steps in a row failed, the last with {describe(exc)}")
            return seqs
        log.error("device error in an engine step", exc_info=exc)
        self._enter_fault(f"device error: {describe(exc)}")
        for seq in seqs:
            seq.fail(ErrorKind.INTERNAL, self._fault_message())
        return seqs

    def _out_of_memory(self, seqs: list[Generation]) -> list[Generation]:
        """The one out-of-memory policy, wherever a step runs out: the allocator's cached blocks
        go back to the device, and the newest request of the step (``seqs`` in admission
        order) gives way with RESOURCE_EXHAUSTED; the others go on, and run the step again.
        NOTE: this holds because a step commits nothing before it has sampled, and the sampler
        draws from (seed, step) alone: the rows that stay get the tokens they would have had.
        Failing the newest (not all) costs one more attempt per row that gives way; a step
        that commits before its last allocation would need all its rows failed instead."""
        self._free_device_memory()
        if not seqs:
            return []
        newest = seqs[-1]
        newest.fail(
            ErrorKind.OUT_OF_MEMORY, "the device ran out of memory during generation; the newest request gave way"
        )
        log.warning("out of memory in an engine step; the newest request gave way", extra={"rows_left": len(seqs) - 1})
        return [newest]

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
            if seq.handle.cancelled:
                seq.abandon()
            elif seq.admitted_at is None:
                seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request started")
            else:  # parked, or preempted and waiting to come back
                seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request finished")

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self, timeout_s: float = 5.0) -> None:
        """Refuse new work, end what runs, and join the engine's threads."""
