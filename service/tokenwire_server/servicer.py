"""Transport: the TextGeneration servicer.

Each RPC is: request id -> validate -> engine call -> convert back. Protobuf stops
here; the engine sees plain ``GenerationRequest`` objects. Every failure leaves as
a deliberate status code (``RpcFailure``), never UNKNOWN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire.validation import (
    FieldViolation,
    Limits,
    Rule,
    validate_generate_request,
    validate_tokenize_request,
)

from .engine import (
    Engine,
    EngineClosed,
    EngineOverloaded,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingOptions,
    TextEvent,
    TokenInfo,
)
from .metrics import Metrics
from .model import LoadedModel
from .status import RpcFailure, from_error, invalid_argument, resource_exhausted
from .text import PromptEncoder

log = logging.getLogger("tokenwire.requests")

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
}


class Undecodable:
    """A request whose bytes are not a valid message; the servicer answers INVALID_ARGUMENT."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error


def _lenient(message_type: type[Message]) -> Any:
    """A request deserializer that never raises (a raise would end the call as UNKNOWN)."""

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_type.DESCRIPTOR.full_name, str(exc))

    return parse


def _check_decoded(request: object) -> None:
    if isinstance(request, Undecodable):
        raise invalid_argument([FieldViolation("request", f"is not a valid {request.type_name}: {request.error}")])


class ServingState:
    """What the servicer needs from the bootstrap: the model and engine once loaded, and drain."""

    def __init__(self) -> None:
        self.loaded: LoadedModel | None = None
        self.engine: Engine | None = None
        self.encoder: PromptEncoder | None = None
        self.draining = False
        self.default_temperature = 0.0


def _tokens(infos: tuple[TokenInfo, ...]) -> list[pb.Token]:
    out = []
    for info in infos:
        token = pb.Token(id=info.id, text=info.text)
        if info.logprob is not None:
            token.logprob = info.logprob
        token.top_logprobs.extend(pb.TopLogprob(id=a.id, text=a.text, logprob=a.logprob) for a in info.top)
        out.append(token)
    return out


class TextGenerationServicer(pb_grpc.TextGenerationServicer):
    def __init__(self, config: Any, state: ServingState, metrics: Metrics) -> None:
        self._config = config
        self._state = state
        self._metrics = metrics
        # Tokenizing a long prompt must not block the event loop.
        self._cpu = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenwire-tokenize")
        self.in_flight = 0  # calls of this service now running (drain waits for them)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the three RPCs; requests that do not parse reach the servicer as ``Undecodable``."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate,
                request_deserializer=_lenient(pb.GenerateRequest),
                response_serializer=pb.TokenChunk.SerializeToString,
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.Tokenize,
                request_deserializer=_lenient(pb.TokenizeRequest),
                response_serializer=pb.TokenizeResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo,
                request_deserializer=_lenient(pb.GetModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        }
        name = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is running, at most ``timeout_s``; True when none is."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # -- helpers -------------------------------------------------------------------

    def _ready(self) -> tuple[LoadedModel, Engine, PromptEncoder]:
        state = self._state
        if state.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on another replica")
        if state.loaded is None or state.engine is None or state.encoder is None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return state.loaded, state.engine, state.encoder

    def _limits(self, loaded: LoadedModel) -> Limits:
        c = self._config
        return Limits(
            max_new_tokens_limit=c.max_new_tokens_limit,
            max_stop_sequences=c.max_stop_sequences,
            max_stop_sequence_chars=c.max_stop_sequence_chars,
            max_chat_messages=c.max_chat_messages,
            vocab_size=loaded.vocab_size,
        )

    @staticmethod
    def _request_id(request_id: str, context: grpc.aio.ServicerContext) -> str:
        if request_id:
            return request_id
        for key, value in context.invocation_metadata() or ():
            if key == "x-request-id" and value:
                return str(value)[:128]
        return uuid.uuid4().hex

    async def _encode(self, encoder: PromptEncoder, kind: str, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._cpu, lambda: encoder.encode(text, templated=kind == "chat"))

    def _render(self, encoder: PromptEncoder, chat: pb.Chat) -> str:
        if not encoder.has_chat_template:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, Rule.NO_CHAT_TEMPLATE.error())
        return encoder.render_chat([(m.role, m.content) for m in chat.messages])

    def _finish_call(self, method: str, code: grpc.StatusCode, started: float) -> None:
        self._metrics.requests.labels(method, code.name).inc()
        self._metrics.latency.labels(method).observe(time.monotonic() - started)

    # -- RPCs ----------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenChunk]:
        started = time.monotonic()
        self.in_flight += 1
        decoded = isinstance(request, pb.GenerateRequest)
        request_id = self._request_id(request.request_id if decoded else "", context)
        code = grpc.StatusCode.OK
        usage_line: dict[str, Any] = {}
        completed = False
        try:
            # aclosing: when grpc drops this stream (the client left), the engine hears of it now,
            # not whenever the abandoned generator is garbage-collected.
            async with contextlib.aclosing(self._generate(request, request_id, started, context, usage_line)) as chunks:
                async for chunk in chunks:
                    yield chunk
            completed = True
        except RpcFailure as failure:
            code = failure.code
            await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug must still end as INTERNAL, never UNKNOWN
            code = grpc.StatusCode.INTERNAL
            log.exception("Generate failed", extra={"request_id": request_id})
            await context.abort(code, f"internal error: {type(exc).__name__}")
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.in_flight -= 1
            if code is grpc.StatusCode.OK and not completed:  # closed early: the client went away
                code = grpc.StatusCode.CANCELLED
            remaining = context.time_remaining()
            if code is grpc.StatusCode.CANCELLED and remaining is not None and remaining <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._finish_call("Generate", code, started)
            extra: dict[str, Any] = {"request_id": request_id, "method": "Generate", "code": code.name}
            extra.update(usage_line)
            if "output" in extra:
                extra["output"] = "".join(extra["output"])
            if self._config.log_prompts and decoded:
                kind = request.WhichOneof("input")
                if kind == "chat":
                    extra["prompt"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                elif kind == "token_ids":
                    extra["prompt"] = list(request.token_ids.ids)
                else:
                    extra["prompt"] = request.prompt
            log.info("request finished", extra=extra)

    async def _generate(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        started: float,
        context: grpc.aio.ServicerContext,
        usage_line: dict[str, Any],
    ) -> AsyncIterator[pb.TokenChunk]:
        _check_decoded(request)
        loaded, engine, encoder = self._ready()
        violations = validate_generate_request(request, self._limits(loaded))
        if violations:
            raise invalid_argument(violations)
        kind = request.WhichOneof("input")
        if kind == "chat":
            prompt_ids = await self._encode(encoder, kind, self._render(encoder, request.chat))
        elif kind == "prompt":
            prompt_ids = await self._encode(encoder, kind, request.prompt)
        else:
            prompt_ids = list(request.token_ids.ids)
        stopping = request.stopping
        explicit_max = stopping.HasField("max_new_tokens")
        max_new = stopping.max_new_tokens if explicit_max else self._config.default_max_new_tokens
        context_length = loaded.context_length
        if len(prompt_ids) >= context_length or (explicit_max and len(prompt_ids) + max_new > context_length):
            raise invalid_argument(
                [
                    FieldViolation(
                        kind or "input",
                        Rule.PROMPT_TOO_LONG.error(
                            count=len(prompt_ids), value=max_new, total=len(prompt_ids) + max_new, limit=context_length
                        ),
                    )
                ]
            )
        max_new = min(max_new, context_length - len(prompt_ids))
        remaining = context.time_remaining()
        sampling = request.sampling
        output = request.output
        gen = GenerationRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=SamplingOptions(
                temperature=sampling.temperature if sampling.HasField("temperature") else self._state.default_temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
                repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
                seed=sampling.seed if sampling.HasField("seed") else None,
            ),
            max_new_tokens=max_new,
            min_new_tokens=stopping.min_new_tokens,
            stop_sequences=tuple(stopping.stop_sequences),
            include_stop_sequence=stopping.include_stop_sequence,
            ignore_eos=stopping.ignore_eos,
            time_limit_s=stopping.time_limit_ms / 1000 if stopping.time_limit_ms else None,
            deadline=time.monotonic() + remaining if remaining is not None else None,
            want_tokens=output.token_ids or output.logprobs or output.top_logprobs > 0,
            want_logprobs=output.logprobs or output.top_logprobs > 0,
            top_logprobs=output.top_logprobs,
            arrival=started,
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def sink(event: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            handle = engine.submit(gen, sink)
        except EngineOverloaded as exc:
            raise resource_exhausted(str(exc), exc.retry_after_s) from None
        except EngineClosed:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on another replica") from None

        metrics = self._metrics
        index = 0
        last = started
        # The completion is kept for the log line only when asked for (--log-prompts).
        output: list[str] | None = usage_line.setdefault("output", []) if self._config.log_prompts else None
        try:
            while True:
                event = await events.get()
                now = time.monotonic()
                if isinstance(event, TextEvent):
                    if index == 0:
                        metrics.ttft.observe(now - started)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    if output is not None:
                        output.append(event.text)
                    yield pb.TokenChunk(request_id=request_id, index=index, text=event.text, tokens=_tokens(event.tokens))
                    index += 1
                elif isinstance(event, FinishEvent):
                    if index == 0:
                        metrics.ttft.observe(now - started)
                    u = event.usage
                    if output is not None:
                        output.append(event.text)
                    metrics.generated_tokens.inc(u.completion_tokens)
                    metrics.prompt_tokens.inc(u.prompt_tokens)
                    usage_line.update(
                        finish_reason=event.reason.value,
                        prompt_tokens=u.prompt_tokens,
                        completion_tokens=u.completion_tokens,
                        queue_ms=round(u.queue_time_s * 1000, 1),
                        ttft_ms=round(u.time_to_first_token_s * 1000, 1),
                        total_ms=round(u.total_time_s * 1000, 1),
                    )
                    yield pb.TokenChunk(
                        request_id=request_id,
                        index=index,
                        text=event.text,
                        tokens=_tokens(event.tokens),
                        finish_reason=_FINISH[event.reason],
                        usage=pb.Usage(
                            prompt_tokens=u.prompt_tokens,
                            completion_tokens=u.completion_tokens,
                            queue_time_ms=u.queue_time_s * 1000,
                            time_to_first_token_ms=u.time_to_first_token_s * 1000,
                            total_time_ms=u.total_time_s * 1000,
                        ),
                    )
                    return
                elif isinstance(event, ErrorEvent):
                    raise from_error(event.kind, event.message, self._config.retry_after_ms / 1000)
        finally:
            handle.cancel()  # no-op when finished; frees the slot when the client left early

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        self.in_flight += 1
        try:
            _check_decoded(request)
            loaded, _, encoder = self._ready()
            violations = validate_tokenize_request(request, self._limits(loaded))
            if violations:
                raise invalid_argument(violations)
            templated = request.WhichOneof("input") == "chat"
            text = self._render(encoder, request.chat) if templated else request.text
            loop = asyncio.get_running_loop()
            ids, spans = await loop.run_in_executor(
                self._cpu, lambda: encoder.tokenize(text, templated=templated, offsets=request.return_offsets)
            )
            response = pb.TokenizeResponse(count=len(ids), ids=ids, text=text)
            if request.return_tokens:
                response.tokens.extend(encoder.token_strings(ids))
            response.offsets.extend(pb.Offset(start=s, end=e) for s, e in spans)
            return response
        except RpcFailure as failure:
            code = failure.code
            await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())
            raise  # unreachable: abort raises
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("Tokenize failed")
            await context.abort(code, f"internal error: {type(exc).__name__}")
            raise
        finally:
            self.in_flight -= 1
            self._finish_call("Tokenize", code, started)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        self.in_flight += 1
        try:
            _check_decoded(request)
            loaded, engine, encoder = self._ready()
            c = self._config
            info = pb.ModelInfo(
                name=loaded.name,
                context_length=loaded.context_length,
                max_new_tokens_limit=c.max_new_tokens_limit,
                default_max_new_tokens=c.default_max_new_tokens,
                eos_token_ids=list(loaded.eos_token_ids),
                has_chat_template=encoder.has_chat_template,
                dtype=loaded.dtype_name,
                device=str(loaded.device),
                engine=engine.name,
                vocab_size=loaded.vocab_size,
                max_active_streams=engine.limits.max_active,
                max_queued_requests=engine.limits.max_queue,
                notes=engine.notes,
            )
            if loaded.bos_token_id is not None:
                info.bos_token_id = loaded.bos_token_id
            return info
        except RpcFailure as failure:
            code = failure.code
            await context.abort(failure.code, failure.message, trailing_metadata=failure.trailing_metadata())
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            log.exception("GetModelInfo failed")
            await context.abort(code, f"internal error: {type(exc).__name__}")
            raise
        finally:
            self.in_flight -= 1
            self._finish_call("GetModelInfo", code, started)
