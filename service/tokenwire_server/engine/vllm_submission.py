"""One request on vLLM (``--engine vllm``): vLLM's stream of token ids through tokenwire's
own ``Generation`` (text rules, finish rules, resume), as the events of the seam."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from ..domain import (
    Alternative,
    ErrorEvent,
    ErrorKind,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    TokenInfo,
)
from ..text import SharedTokenizer

if TYPE_CHECKING:
    from .vllm_backend import VllmBackend, VllmLora


def _cpu() -> Any:
    import torch

    return torch.device("cpu")  # where a sampled request's (unused) generator lives: vLLM samples


_CPU = None  # set on first use, so importing this module does not import torch


class VllmSubmission:
    """One request on vLLM: its token ids through tokenwire's own ``Generation``."""

    def __init__(self, backend: VllmBackend, request: GenerationRequest, lora: VllmLora | None = None) -> None:
        from .generation import Generation

        global _CPU
        if _CPU is None:
            _CPU = _cpu()
        self._backend = backend
        self._request = request
        self._lora = lora  # the adapter's LoRARequest goes with the call; its stream count with the release
        self._events: list[Event] = []
        self._handle = RequestHandle()
        self._generation = Generation(
            request, self._handle, self._events.append, backend.tokenizer, backend.describe().eos_token_ids, _CPU
        )
        self._vllm_id = f"{request.request_id}-{id(self):x}"  # unique even when callers reuse ids
        self._started = False
        self._released = False
        self._ended: ErrorEvent | None = None  # end(): the last event, whatever vLLM sends after
        # Since when the chunk yielded last has waited for the transport to take the next (None:
        # not waiting): gRPC's yield waits while the client's window is full.
        self._unread_since: float | None = None
        self._watch: asyncio.TimerHandle | None = None

    def _release(self) -> None:
        """Give back this request's place in the count of requests in flight, once."""
        if not self._released:
            self._released = True
            self._backend._done(self._lora)

    def cancel(self) -> None:
        if not self._started:  # cancelled before its stream was read: vLLM never saw it
            self._handle.cancel()
            self._release()
        elif not self._handle.cancelled and not self._generation.finished:
            self._handle.cancel()
            asyncio.ensure_future(self._backend.engine.abort(self._vllm_id))

    def end(self, event: ErrorEvent) -> None:
        """Abort the vLLM request; the stream yields ``event`` next and stops."""
        self._ended = event
        self.cancel()

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            async with contextlib.aclosing(self._stream()) as events:
                async for event in events:
                    if self._ended is not None:
                        break
                    self._unread_since = time.monotonic()
                    self._watch_reader()
                    yield event
                    self._unread_since = None
                    if isinstance(event, FinishEvent | ErrorEvent):
                        return
            if self._ended is not None:
                yield self._ended
        finally:
            if self._watch is not None:
                self._watch.cancel()

    def _watch_reader(self) -> None:
        """Check, ``--stalled-reader-timeout`` after the chunk now waiting was yielded, that the
        reader has taken it; one timer per stream, set again from the chunk waiting then."""
        timeout = self._backend._settings.stalled_reader_timeout_s
        if timeout <= 0 or self._watch is not None or self._unread_since is None:
            return
        delay = max(0.0, self._unread_since + timeout - time.monotonic())
        self._watch = asyncio.get_running_loop().call_later(delay, self._check_reader, timeout)

    def _check_reader(self, timeout: float) -> None:
        self._watch = None
        since = self._unread_since
        if since is None or self._ended is not None:
            return
        if time.monotonic() - since < timeout:
            self._watch_reader()
            return
        # vLLM goes on decoding while the chunk waits; end that now: the reader gets this status
        # next, once it takes the chunk before it.
        self._backend.observer.reader_stalled(self._request.tenant)
        self.end(
            ErrorEvent(
                ErrorKind.STALLED_READER,
                f"the caller stopped reading this stream: a chunk stayed unread for {timeout:g} s "
                "(--stalled-reader-timeout) and the server stopped generating for it; read a stream as it comes, "
                "or resume it from the tokens received (GenerateRequest.resume)",
            )
        )

    async def _stream(self) -> AsyncGenerator[Event, None]:
        from vllm.inputs import TokensPrompt

        backend, request, generation = self._backend, self._request, self._generation
        if self._released:
            return
        self._started = True
        tokenizer = backend.tokenizer
        started = time.monotonic()
        limit_at = started + request.time_limit_s if request.time_limit_s else None
        admitted = False
        if generation.ended_at_cut is not None:  # a resume whose tokens already ended the stream
            generation.finish(generation.ended_at_cut)
            self._release()
            for event in self._events:
                yield event
            return
        try:
            stream = backend.engine.generate(
                TokensPrompt(prompt_token_ids=list(generation.context_ids)),
                backend.sampling_params(request),
                self._vllm_id,
                lora_request=None if self._lora is None else self._lora.request,
            )
            async with contextlib.aclosing(stream) as outputs:
                while True:
                    try:
                        if limit_at is None:
                            out = await anext(outputs)
                        else:
                            out = await asyncio.wait_for(anext(outputs), max(0.0, limit_at - time.monotonic()))
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        generation.finish(FinishReason.TIME_LIMIT)
                        break
                    if self._handle.cancelled:
                        break
                    if not admitted:
                        admitted = True
                        generation.mark_admitted(started)
                    if generation.scores_prompt and getattr(out, "prompt_logprobs", None):
                        generation.score_prompt(0, _prompt_scores(out.prompt_logprobs, request, tokenizer))
                    completion = out.outputs[0]
                    positions = completion.logprobs or []
                    for i, token in enumerate(completion.token_ids):
                        logprob, top = _logprobs(
                            positions[i] if i < len(positions) else None, token, request, tokenizer
                        )
                        if generation.add_token(int(token), logprob, top):
                            break
                    if getattr(out, "num_cached_tokens", None):
                        generation.cached_prompt_tokens = int(out.num_cached_tokens)
                    while self._events:
                        yield self._events.pop(0)
                    if generation.finished:
                        break
                    if limit_at is not None and time.monotonic() >= limit_at:
                        generation.finish(FinishReason.TIME_LIMIT)
                        break
                    if out.finished:  # vLLM ended it (EOS or length) before tokenwire's rules did
                        generation.finish(FinishReason.LENGTH)
                        break
            if not generation.finished and not self._handle.cancelled:
                generation.finish(FinishReason.LENGTH)
        except Exception as exc:  # vLLM's errors end the call as a status, never UNKNOWN
            if not generation.finished:
                kind = ErrorKind.SHUTDOWN if backend.engine.errored else ErrorKind.INTERNAL
                generation.fail(kind, f"vLLM: {type(exc).__name__}: {exc}")
        finally:
            if not generation.finished or self._handle.cancelled:
                with contextlib.suppress(Exception):
                    await backend.engine.abort(self._vllm_id)
            self._release()
        while self._events:
            event = self._events.pop(0)
            yield event
            if isinstance(event, FinishEvent | ErrorEvent):
                return


def _logprobs(
    position: Any, token: int, request: GenerationRequest, tokenizer: SharedTokenizer
) -> tuple[float | None, tuple[Alternative, ...]]:
    """vLLM's {token_id: Logprob} for one generated position as tokenwire's (logprob, alternatives)."""
    if position is None or not (request.want_logprobs or request.top_logprobs):
        return None, ()
    return _ranked(position, token, request.top_logprobs, tokenizer)


def _ranked(
    position: Any, token: int, count: int, tokenizer: SharedTokenizer
) -> tuple[float | None, tuple[Alternative, ...]]:
    """One position of vLLM's logprobs ({token_id: Logprob}): ``token``'s log-probability and the
    ``count`` best-ranked alternatives."""
    chosen = position.get(token)
    logprob = float(chosen.logprob) if chosen is not None else None
    ranked = sorted(((entry.rank, tid, entry.logprob) for tid, entry in position.items() if entry.rank is not None))
    top = tuple(
        Alternative(int(tid), tokenizer.decode([int(tid)], skip_special_tokens=False), float(lp))
        for _, tid, lp in ranked[:count]
    )
    return logprob, top


def _prompt_scores(positions: Any, request: GenerationRequest, tokenizer: SharedTokenizer) -> list[TokenInfo]:
    """vLLM's prompt logprobs (one {token_id: Logprob} per prompt token, None for the first) as
    the TokenInfos of prompt tokens 1 ... (``Generation.score_prompt(0, ...)``)."""
    ids = request.prompt_ids
    out = []
    for i, position in enumerate(list(positions)[1 : len(ids)], start=1):
        token = ids[i]
        logprob, top = _ranked(position or {}, token, request.prompt_top_logprobs, tokenizer)
        out.append(TokenInfo(token, tokenizer.decode([token], skip_special_tokens=False), logprob, top))
    return out
