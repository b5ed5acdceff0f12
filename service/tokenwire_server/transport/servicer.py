"""The TextGeneration servicer: each RPC is validate -> backend -> convert back.

It holds one ``GenerationBackend`` (attached once the model is ready) and nothing
of the model itself. Status mapping, metrics and the log line are the wrapper's
(``calls``); proto <-> domain mapping is ``conversion``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, TypeVar

import grpc
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import (
    MAX_CHUNK_INDEX,
    FieldViolation,
    Rule,
    validate_generate_request,
    validate_tokenize_request,
)

from ..backend import GenerationBackend, Submission
from ..domain import (
    ErrorEvent,
    ErrorKind,
    Event,
    FinishEvent,
    GenerationRequest,
    InvalidResume,
    ModelDescription,
    PromptTooLong,
    TenantOverLimit,
    TextEvent,
    UnknownAdapter,
)
from ..metrics import Metrics
from ..security import Identities
from ..tenancy import QuotaLedger, Tenants
from . import conversion
from .calls import Call, Calls, check_decoded, lenient, register
from .status import DRAINING, HANDOFF, RpcFailure, from_error, invalid_argument

if TYPE_CHECKING:
    from .calls import Context

T = TypeVar("T")
R = TypeVar("R")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


@dataclasses.dataclass
class _Sample:
    """One sample's stream within a Generate call (GenerateRequest.n): its next chunk index, its
    seed (on its first chunk), its tokens so far (charged to the quota) and its last chunk's time."""

    index: int
    seed: int | None
    generated: int = 0
    last: float = 0.0


async def _merged(submissions: list[Submission]) -> AsyncGenerator[tuple[int, Event], None]:
    """Every sample's events as ``(sample, event)``, as they come. One sample: its own stream, as is.
    Several: each read by a task into a queue of one place per sample, so a caller that stops
    reading stops the reading here too (the engine sees the stream fall behind, as with one)."""
    if len(submissions) == 1:
        async for event in submissions[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue(maxsize=len(submissions))

    async def pump(number: int, submission: Submission) -> None:
        try:
            async for event in submission:
                await queue.put((number, event))
        finally:
            await queue.put((number, None))

    tasks = [asyncio.create_task(pump(number, submission)) for number, submission in enumerate(submissions)]
    try:
        running = len(tasks)
        while running:
            number, item = await queue.get()
            if item is None:  # that sample's stream has ended (a failure in reading it ends the call)
                running -= 1
                task = tasks[number]
                await asyncio.wait([task])
                failure = None if task.cancelled() else task.exception()
                if failure is not None:
                    raise failure
                continue
            yield number, item
    finally:
        for task in tasks:
            task.cancel()


class TextGenerationServicer:
    def __init__(
        self,
        metrics: Metrics,
        *,
        retry_after_s: float = 0.5,
        log_prompts: bool = False,
        tenants: Tenants | None = None,
        identities: Identities | None = None,
    ) -> None:
        self._metrics = metrics
        self._tenants = tenants or Tenants()
        self._identities = identities or Identities(self._tenants)
        self._quota = QuotaLedger(self._tenants, retry_after_s)
        self._retry_after_s = retry_after_s
        self._log_prompts = log_prompts
        self._backend: GenerationBackend | None = None
        self._description: ModelDescription | None = None
        self._draining = False
        self._streams: set[Submission] = set()  # the Generate streams in flight, for the hand-off
        # Streams in flight per LoRA adapter: an unloaded adapter's metric series go after its last.
        self._adapter_streams: dict[str, int] = {}
        self._handing_off = False
        self.calls = Calls(metrics)

    # -- what bootstrap tells it -------------------------------------------------------

    def attach(self, backend: GenerationBackend) -> None:
        """The model is ready: serve it through ``backend``."""
        self._description = backend.describe()
        self._backend = backend

    def begin_drain(self) -> None:
        """From now on every new call is UNAVAILABLE; calls in flight go on."""
        self._draining = True

    def hand_off(self) -> None:
        """End every stream in flight with UNAVAILABLE and a trailer that says "resume this
        elsewhere" (the drain's hand-off); clients that resume continue on another replica."""
        self._handing_off = True
        for submission in list(self._streams):
            submission.end(ErrorEvent(ErrorKind.HANDOFF, HANDOFF))

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the three RPCs; requests that do not parse reach the handlers as ``Undecodable``."""
        calls = self.calls
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                calls.stream("Generate", self._generate),
                request_deserializer=lenient(pb.GenerateRequest),
                response_serializer=pb.TokenChunk.SerializeToString,
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                calls.unary("Tokenize", self._tokenize),
                request_deserializer=lenient(pb.TokenizeRequest),
                response_serializer=pb.TokenizeResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                calls.unary("GetModelInfo", self._model_info),
                request_deserializer=lenient(pb.GetModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        }
        register(server, SERVICE_NAME, handlers)

    def refresh(self) -> None:
        """What the backend serves changed (an adapter loaded or unloaded): describe it again;
        an adapter no longer loaded, with no stream left, loses its metric series."""
        if self._backend is not None:
            self._description = self._backend.describe()
            self._forget_unloaded_adapters()

    def _forget_unloaded_adapters(self) -> None:
        """Drop the metric series of every adapter no longer loaded with no stream left (the one
        rule, at an unload and at an adapter's last stream's end)."""
        if self._description is not None:
            loaded = {adapter.name for adapter in self._description.adapters}
            for name in self._metrics.adapter_names() - loaded - set(self._adapter_streams):
                self._metrics.forget_adapter(name)

    @property
    def tenants(self) -> Tenants:
        return self._tenants

    def tenant_of(self, context: Context) -> str:
        return self._identities.tenant_of(context)

    def serving(self) -> tuple[GenerationBackend, ModelDescription]:
        """The backend and its description; UNAVAILABLE while loading or draining."""
        if self._draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, DRAINING)
        if self._backend is None or self._description is None:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        return self._backend, self._description

    # -- RPCs ------------------------------------------------------------------------

    async def _generate(
        self, request: pb.GenerateRequest, context: Context, call: Call
    ) -> AsyncIterator[pb.TokenChunk]:
        check_decoded(request)
        if self._log_prompts:
            call.fields["prompt"] = conversion.prompt_for_log(request)
        backend, description = self.serving()
        violations = validate_generate_request(request, conversion.validation_limits(description))
        if violations:
            raise invalid_argument(violations)
        call.input_field = conversion.input_field(request)
        tenant = call.tenant = self._identities.tenant_of(context)
        priority = conversion.priority_of(request)
        call.priority = priority.label
        call.fields.update(tenant=tenant, priority=priority.label)
        policy = self._tenants.policy(tenant)
        if not policy.allows(priority):
            names = conversion.PRIORITY_NAMES
            raise invalid_argument(
                [
                    FieldViolation(
                        "priority",
                        Rule.PRIORITY_ABOVE_CAP.error(
                            value=names[priority], tenant=tenant, limit=names[policy.max_priority]
                        ),
                    )
                ]
            )
        if request.adapter:
            call.fields["adapter"] = request.adapter[:64]
            if not policy.may_use(request.adapter):
                raise RpcFailure(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"adapter: tenant {tenant!r} may not use adapter {request.adapter[:64]!r} "
                    f"(its adapters: {', '.join(policy.adapters or ()) or 'none'})",
                )
            loaded = [adapter.name for adapter in description.adapters]
            if request.adapter not in loaded and description.applies_adapters:
                raise UnknownAdapter(request.adapter[:64], loaded)
        self._refused_for_tenant(self._quota.check, tenant)
        limits = description.limits
        # Bounded: a prompt that cannot fit is refused unread, or read only one token past the limit.
        encoding = await backend.encode(conversion.prompt_of(request), max_tokens=limits.max_request_tokens)
        if encoding.truncated:
            asked = conversion.max_new_tokens_asked(request, limits)
            raise PromptTooLong(
                limits.max_request_tokens, asked, limits.max_request_tokens, at_least=True, chars=encoding.chars
            )
        fmt = conversion.response_format(request)
        if fmt is not None:
            compile_s = await backend.check_format(fmt, tenant)  # InvalidResponseFormat: before any chunk
            if compile_s is not None:
                self._metrics.grammar_compile.labels(fmt.kind).observe(compile_s)
            self._metrics.constrained.labels(fmt.kind).inc()
            call.fields["response_format"] = fmt.kind
        remaining = context.time_remaining()
        generation = conversion.generation_request(
            request,
            call.request_id,
            encoding.ids,
            description,
            arrival=call.started,
            deadline=time.monotonic() + remaining if remaining is not None else None,
            tenant=tenant,
        )
        if request.resume.next_index + generation.max_new_tokens > MAX_CHUNK_INDEX:  # the max_new_tokens settled on
            raise InvalidResume(
                Rule.RESUME_INDEX_OVERFLOW.error(value=request.resume.next_index, limit=generation.max_new_tokens),
                field="resume.next_index",
            )
        # What the model reads is charged as the call is admitted: the prompt and a resumed
        # stream's tokens (a second prompt, read as context; charged as prompt tokens). What
        # it generates here is charged as the call ends, however it ends. The quota is checked
        # again here, with no await between the check, the admission and the charge: calls
        # that passed the first check together (while their prompts were encoded) cannot all
        # be admitted on the same unspent minute.
        self._refused_for_tenant(self._quota.check, tenant)
        requests = conversion.samples(generation, request.n)
        submissions = self._submit_all(backend, requests)
        # The prompt is charged once, however many samples read it (the others find it cached).
        read = len(generation.prompt_ids) + len(generation.resume_ids)
        self._quota.charge(tenant, read)
        metrics = self._metrics
        output: list[str] | None = [] if self._log_prompts else None
        first = request.resume.next_index  # a resumed stream goes on from the caller's next index
        samples = [_Sample(first, None if r.sampling.greedy else r.sampling.seed) for r in requests]
        started = False
        finished = 0
        completion_tokens = 0
        if generation.resume_ids:
            call.fields["resumed_tokens"] = len(generation.resume_ids)
            metrics.resumes.inc()
        if len(submissions) > 1:
            call.fields["samples"] = len(submissions)
        self._streams.update(submissions)
        if self._handing_off:  # it got past the drain's refusal just before the hand-off
            for submission in submissions:
                submission.end(ErrorEvent(ErrorKind.HANDOFF, HANDOFF))
        adapter = generation.adapter  # a loaded adapter's name: label values bounded by --max-loras
        if adapter:
            metrics.adapter_streams.labels(adapter).inc(len(submissions))
            self._adapter_streams[adapter] = self._adapter_streams.get(adapter, 0) + 1
        try:
            async with contextlib.aclosing(_merged(submissions)) as events:
                async for number, event in events:
                    now = time.monotonic()
                    sample = samples[number]
                    if isinstance(event, ErrorEvent):
                        if event.kind is ErrorKind.HANDOFF:
                            metrics.handoffs.inc()
                        if event.kind is ErrorKind.FORMAT_DEAD_END and fmt is not None:
                            raise invalid_argument([FieldViolation(fmt.field, event.message)])
                        raise from_error(event.kind, event.message, self._retry_after_s)
                    if not started:
                        started = True
                        metrics.ttft.observe(now - call.started)
                        metrics.tenant_ttft.labels(tenant, priority.label).observe(now - call.started)
                    elif isinstance(event, TextEvent) and sample.index != first:
                        metrics.itl.observe(now - sample.last)
                    sample.last = now
                    if output is not None:
                        output.append(event.text)
                    chunk_seed = sample.seed if sample.index == first else None
                    if isinstance(event, FinishEvent):
                        u = event.usage
                        # Generated here, not before the cut.
                        new_tokens = max(0, u.completion_tokens - len(generation.resume_ids))
                        metrics.generated_tokens.inc(new_tokens)
                        metrics.tenant_tokens.labels(tenant, priority.label, "completion").inc(new_tokens)
                        if adapter:
                            metrics.adapter_tokens.labels(adapter).inc(new_tokens)
                        sample.generated = new_tokens
                        metrics.prefix_hit_tokens.inc(u.cached_prompt_tokens)
                        completion_tokens += u.completion_tokens
                        finished += 1
                        yield conversion.chunk(
                            call.request_id, sample.index, event.text, event.tokens, event.reason, u, chunk_seed,
                            event.matched, event.prompt, number,
                        )  # fmt: skip
                        if finished < len(samples):
                            continue
                        metrics.prompt_tokens.inc(read)
                        metrics.tenant_tokens.labels(tenant, priority.label, "prompt").inc(read)
                        # The call's log line: the last sample's finish, every sample's tokens.
                        call.usage = dataclasses.replace(u, completion_tokens=completion_tokens)
                        call.reason = event.reason.value
                        call.fields.update(conversion.usage_fields(call.usage, event.reason))
                        if output is not None:
                            call.fields["output"] = "".join(output)
                        return
                    sample.generated += max(1, len(event.tokens))  # a chunk holds at least one token
                    yield conversion.chunk(
                        call.request_id, sample.index, event.text, event.tokens, seed=chunk_seed, prompt=event.prompt,
                        sample=number,
                    )  # fmt: skip
                    sample.index += 1
        finally:
            if adapter:
                metrics.adapter_streams.labels(adapter).dec(len(submissions))
                self._adapter_streams[adapter] -= 1
                if not self._adapter_streams[adapter]:
                    del self._adapter_streams[adapter]
                    self._forget_unloaded_adapters()  # unloaded meanwhile, this was its last stream
            self._quota.charge(tenant, sum(sample.generated for sample in samples))
            for submission in submissions:
                self._streams.discard(submission)
                submission.cancel()  # no-op when finished; frees the slot when the client left early

    def _submit_all(self, backend: GenerationBackend, requests: list[GenerationRequest]) -> list[Submission]:
        """Every sample's submission, or none: a refusal of one (the server is full, the tenant over its
        limit) cancels those submitted before it, and the call is refused whole."""
        submissions: list[Submission] = []
        try:
            for sample in requests:
                submissions.append(self._refused_for_tenant(backend.submit, sample))
        except BaseException:
            for submission in submissions:
                submission.cancel()
            raise
        return submissions

    def _refused_for_tenant(self, admit: Callable[[T], R], arg: T) -> R:
        """``admit(arg)``, counting a refusal for the tenant's own limit in its metrics."""
        try:
            return admit(arg)
        except TenantOverLimit as exc:
            self._metrics.tenant_refusals.labels(exc.tenant, exc.limit).inc()
            raise

    async def _tokenize(self, request: pb.TokenizeRequest, context: Context, call: Call) -> pb.TokenizeResponse:
        check_decoded(request)
        backend, description = self.serving()
        violations = validate_tokenize_request(request, conversion.validation_limits(description))
        if violations:
            raise invalid_argument(violations)
        call.input_field = request.WhichOneof("input") or "input"
        encoding = await backend.encode(
            conversion.prompt_of(request), offsets=request.return_offsets, tokens=request.return_tokens
        )
        call.fields["prompt_tokens"] = len(encoding.ids)
        response = conversion.tokenize_response(encoding, request)
        size = response.ByteSize()
        if size > description.limits.max_message_bytes:  # gRPC would refuse to send it, and the call look OK here
            why = conversion.reply_too_large(size, description.limits.max_message_bytes, request)
            raise invalid_argument([FieldViolation(call.input_field, why)])
        return response

    async def _model_info(self, request: pb.GetModelInfoRequest, context: Context, call: Call) -> pb.ModelInfo:
        check_decoded(request)
        _, description = self.serving()
        return conversion.model_info(description)
