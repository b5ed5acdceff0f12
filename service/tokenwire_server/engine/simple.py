"""The `simple` engine: one ``model.generate()`` per request, the classic pattern.

Kept as the baseline the batched engine is measured against, and as a fallback.
A bounded pool of worker threads each runs one ``generate()`` at a time. Tokens
are chosen by the shared ``Sampler`` (through a logits processor that leaves only
the chosen token), so per-request seeds work without touching torch's global RNG;
a stopping criterion ends generation as soon as the request is finished,
cancelled or past its deadline, or its reader has fallen behind: then the request
is parked (its worker goes to the next request) and, once the reader has caught
up, generated again from its prompt and tokens so far, with the same tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

from ..domain import EngineObserver, ErrorKind, FinishReason, GenerationRequest
from ..model import LoadedModel
from .base import AdmissionQueue, Engine, EngineLimits
from .generation import Generation
from .sampling import Sampler
from .scoring import score, token_infos

log = logging.getLogger(__name__)


class _PickToken(LogitsProcessor):
    """Runs the shared sampler and leaves only its choice, so generate's argmax takes it."""

    def __init__(self, sampler: Sampler, seq: Generation) -> None:
        self._sampler = sampler
        self._seq = seq
        self.last: tuple[int, float | None, Any, Any] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = self._sampler(scores, [self._seq])[0]
        out = torch.full_like(scores, float("-inf"))
        out[0, self.last[0]] = 0.0
        return out


class _FeedGeneration(BaseStreamer):
    """generate() calls put() with each new token: hand it to the sequence."""

    def __init__(self, seq: Generation, picker: _PickToken, engine: SimpleEngine) -> None:
        self._seq = seq
        self._picker = picker
        self._engine = engine
        self._prompt_seen = False
        self._emitted = False  # a token came out of this generate() call (the first follows a prefill)
        self._last = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            self._last = now
            return
        if self._seq.finished or self._seq.handle.cancelled:
            return
        # One token of one request per step: prefill for the first, decode after.
        if self._emitted:
            self._engine.observer.decode_step(now - self._last)
        else:
            self._engine.observer.prefill_step(now - self._last, self._seq.context_len)
        self._emitted = True
        self._last = now
        token = int(value.reshape(-1)[0])
        _, logprob, top, named = self._picker.last if self._picker.last is not None else (token, None, (), ())
        self._seq.add_token(token, logprob, top, named)
        self._engine._mark_progress()

    def end(self) -> None:
        pass


class _StopWhenDone(StoppingCriteria):
    def __init__(self, seq: Generation, queue: AdmissionQueue) -> None:
        self._seq = seq
        self._queue = queue
        self.behind = False  # stopped because the reader fell behind: the request is to be parked

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seq = self._seq
        queue = self._queue
        queue.expire_parked()  # every worker may be busy: the one at work looks at the parked streams
        if not (seq.finished or seq.handle.cancelled) and queue.behind(seq):
            self.behind = True  # parked once generate() returns
        done = seq.finished or seq.handle.cancelled or self.behind
        if not done:
            expired = seq.expired(time.monotonic())
            if expired is ErrorKind.DEADLINE:
                seq.fail(ErrorKind.DEADLINE, "the call's deadline passed during generation")
                done = True
            elif expired is FinishReason.TIME_LIMIT:
                seq.finish(FinishReason.TIME_LIMIT)
                done = True
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class SimpleEngine(Engine):
    name = "simple"

    def __init__(
        self, loaded: LoadedModel, limits: EngineLimits, workers: int, observer: EngineObserver | None = None
    ) -> None:
        super().__init__(
            loaded,
            EngineLimits(
                workers,
                limits.max_queue,
                limits.kv_cache_tokens,
                limits.retry_after_s,
                stream_backlog=limits.stream_backlog,
                stalled_reader_timeout_s=limits.stalled_reader_timeout_s,
            ),
            observer,
        )
        self._workers = workers
        self._threads: list[threading.Thread] = []
        self._running: set[Generation] = set()
        self._running_lock = threading.Lock()  # workers add and remove, submit() reads
        self._sampler = Sampler(loaded.eos_token_ids)

    def start(self) -> None:
        for i in range(self._workers):
            thread = threading.Thread(target=self._work, name=f"tokenwire-simple-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout_s: float = 5.0) -> None:
        self.queue.close()
        self._fail_waiting()
        for thread in self._threads:
            thread.join(timeout_s)

    def running(self) -> list[tuple[GenerationRequest, int]]:
        with self._running_lock:
            running = list(self._running)
        return [(seq.request, len(seq.generated)) for seq in running]

    def _work(self) -> None:
        while not self.queue.closed:
            taken = self.queue.dequeue(lambda seq: True, block=True, max_count=1)
            for seq in taken:
                with self._running_lock:
                    self._running.add(seq)
                behind = False
                try:
                    behind = self._generate(seq)
                    self._step_worked()
                except Exception as exc:  # one request's failure must not take the worker down (engine.faults)
                    self._step_failed([seq], exc)
                finally:
                    with self._running_lock:
                        self._running.discard(seq)
                    if seq.handle.cancelled and not seq.finished:
                        seq.abandon()
                    if behind and not seq.finished:
                        # Its reader fell behind: the worker moves on, and the request comes back (read
                        # again, as a resumed stream) once the reader has caught up. Last here: another
                        # worker may take it back at once.
                        seq.park()
                        self.queue.park(seq)
                        self._parked(seq)
                    else:
                        self.queue.vacate(seq)

    def _generate(self, seq: Generation) -> bool:
        """Run ``seq`` until it ends, or its reader falls behind (then return True: to be parked)."""
        loaded = self.loaded
        self._admit([seq])
        if seq.handle.cancelled:
            return False
        input_ids = torch.tensor([seq.context_ids], device=loaded.device)  # a resumed stream: its tokens too
        if seq.scores_prompt:
            self._score_prompt(seq)
            if seq.request.max_new_tokens == 0:  # a scoring call: nothing to generate
                seq.finish(FinishReason.LENGTH)
                return False
        picker = _PickToken(self._sampler, seq)
        stop = _StopWhenDone(seq, self.queue)
        config = GenerationConfig(
            # What is left: a resumed or parked stream's ``generated`` holds the tokens it had.
            max_new_tokens=seq.request.max_new_tokens - len(seq.generated),
            do_sample=False,
            eos_token_id=None,  # the sequence decides about end of sequence (min_new_tokens, ignore_eos)
            pad_token_id=loaded.pad_token_id,
            bos_token_id=loaded.bos_token_id,
        )
        with torch.inference_mode():
            loaded.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=LogitsProcessorList([picker]),
                stopping_criteria=StoppingCriteriaList([stop]),
                streamer=_FeedGeneration(seq, picker, self),
            )
        if stop.behind and not seq.finished:
            return True
        if not seq.finished and not seq.handle.cancelled:
            seq.finish(FinishReason.LENGTH)
        return False

    def _score_prompt(self, seq: Generation) -> None:
        """Score the prompt (``OutputOptions.prompt_logprobs``) with one forward of it of its own, before
        ``generate()`` reads it again: the baseline engine pays a second prefill for it."""
        ids = seq.request.prompt_ids
        if len(ids) < 2:
            return
        request = seq.request
        with torch.inference_mode():
            logits = self.loaded.model(input_ids=torch.tensor([ids[:-1]], device=self.loaded.device)).logits[0]
            values = score(logits, ids[1:], request.prompt_top_logprobs, request.logprobs_of)
        seq.score_prompt(
            0, token_infos(values, ids[1:], request.prompt_top_logprobs, request.logprobs_of, seq.token_text)
        )
