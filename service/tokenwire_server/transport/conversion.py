"""Conversion between the protobuf contract and the domain, as pure functions.

No I/O, no grpc context, no model: every function here is a mapping that a unit
test can check with plain values. Defaults for unset fields come from the
``ModelDescription`` (the model's generation config and the server's limits), so
they live in one place.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import uuid
from collections.abc import Iterable

from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import (
    MAX_FORMAT_CHARS,
    MAX_JSON_SCHEMA_DEPTH,
    MAX_QUOTED_CHARS,
    MAX_REQUEST_ID_CHARS,
    Limits,
)

from ..domain import (
    DEFAULT_TENANT,
    ChatPrompt,
    Encoding,
    FinishReason,
    GenerationRequest,
    InvalidResume,
    ModelDescription,
    Priority,
    Prompt,
    RequestLimits,
    ResponseFormat,
    SamplingOptions,
    TextPrompt,
    TokenInfo,
    TokenPrompt,
    Usage,
    fit_to_context,
)
from .status import TRAILER_BYTES

REQUEST_ID_METADATA = "x-request-id"

FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
}


def valid_request_id(value: str) -> bool:
    """An id the server echoes (chunks, the ``x-request-id`` trailer, logs): at most
    ``MAX_REQUEST_ID_CHARS`` printable characters (no control characters, no lone surrogates)."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not value.isprintable():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def request_id(field: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The request's id: its own field, else the ``x-request-id`` metadata, else a new one.

    Checked before anything echoes it: an invalid id (too long, control characters) is
    replaced by a server id, so that what a caller sends never grows a trailer or a log line
    (the request field's own violation still ends the call INVALID_ARGUMENT)."""
    if field:
        return field if valid_request_id(field) else uuid.uuid4().hex
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA and value:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            return text if valid_request_id(text) else uuid.uuid4().hex
    return uuid.uuid4().hex


def validation_limits(description: ModelDescription) -> Limits:
    """The limits ``tokenwire.validation`` checks a request against, as this server enforces them."""
    limits = description.limits
    return Limits(
        max_new_tokens_limit=limits.max_new_tokens_limit,
        max_stop_sequences=limits.max_stop_sequences,
        max_stop_sequence_chars=limits.max_stop_sequence_chars,
        max_chat_messages=limits.max_chat_messages,
        vocab_size=limits.vocab_size,
        max_stop_token_ids=limits.max_stop_token_ids,
        max_logit_bias=limits.max_logit_bias,
        max_logprobs_of=limits.max_logprobs_of,
        max_top_logprobs=limits.max_top_logprobs,
        max_n=limits.max_n,
    )


def prompt_of(request: pb.GenerateRequest | pb.TokenizeRequest) -> Prompt:
    """The oneof ``input`` of a (validated) request as a domain prompt."""
    kind = request.WhichOneof("input")
    if kind == "chat":
        return ChatPrompt(tuple((m.role, m.content) for m in request.chat.messages))
    if isinstance(request, pb.GenerateRequest):
        if kind == "token_ids":
            return TokenPrompt(tuple(request.token_ids.ids))
        return TextPrompt(request.prompt)
    return TextPrompt(request.text)


def input_field(request: pb.GenerateRequest) -> str:
    """The field that holds the prompt, for error details."""
    return request.WhichOneof("input") or "input"


def sampling_options(params: pb.SamplingParams, defaults: SamplingOptions) -> SamplingOptions:
    """A request's sampling options: each unset field takes the model's default."""
    return SamplingOptions(
        temperature=params.temperature if params.HasField("temperature") else defaults.temperature,
        top_k=params.top_k if params.HasField("top_k") else defaults.top_k,
        top_p=params.top_p if params.HasField("top_p") else defaults.top_p,
        repetition_penalty=(
            params.repetition_penalty if params.HasField("repetition_penalty") else defaults.repetition_penalty
        ),
        seed=params.seed if params.HasField("seed") else None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in params.logit_bias.items())),
    )


def response_format(request: pb.GenerateRequest) -> ResponseFormat | None:
    """The request's (validated) response format as a domain value; None when it has none."""
    if not request.HasField("response_format"):
        return None
    fmt = request.response_format
    kind = fmt.WhichOneof("format")
    if kind == "choice":
        return ResponseFormat("choice", options=tuple(fmt.choice.options))
    if kind == "json_object":
        return ResponseFormat("json_object")
    assert kind is not None, "validation refuses a response_format with no format set"
    return ResponseFormat(kind, spec=getattr(fmt, kind))


_PRIORITIES = {
    pb.PRIORITY_UNSPECIFIED: Priority.NORMAL,
    pb.PRIORITY_HIGH: Priority.HIGH,
    pb.PRIORITY_LOW: Priority.LOW,
}
PRIORITY_NAMES = {
    Priority.NORMAL: "PRIORITY_UNSPECIFIED (normal)",
    Priority.HIGH: "PRIORITY_HIGH",
    Priority.LOW: "PRIORITY_LOW",
}


def priority_of(request: pb.GenerateRequest) -> Priority:
    """The domain priority of a validated request (an unknown value was refused by validation)."""
    return _PRIORITIES[request.priority]


def generation_request(
    request: pb.GenerateRequest,
    request_id: str,
    prompt_ids: list[int],
    description: ModelDescription,
    *,
    arrival: float,
    deadline: float | None,
    tenant: str = DEFAULT_TENANT,
) -> GenerationRequest:
    """The engine's request for a validated GenerateRequest whose prompt encoded to ``prompt_ids``.

    Raises ``PromptTooLong`` when the prompt and the asked-for completion do not fit the
    context, and ``InvalidResume`` for a resume with more tokens than the request may generate.
    A request that samples without a seed gets one here, so the stream can say which
    (``TokenChunk.seed``) and a resume of it continues exactly.
    """
    stopping = request.stopping
    output = request.output
    limits = description.limits
    max_new = fit_to_context(
        len(prompt_ids),
        stopping.max_new_tokens if stopping.HasField("max_new_tokens") else None,
        limits.default_max_new_tokens,
        limits.max_request_tokens,
    )
    resume = tuple(request.resume.generated_token_ids)
    if len(resume) > max_new:
        raise InvalidResume(
            f"holds {len(resume)} tokens, more than this request may generate ({max_new}: its max_new_tokens, "
            "or the server's default fitted to the context beside the prompt)"
        )
    sampling = sampling_options(request.sampling, description.default_sampling)
    if sampling.seed is None and not sampling.greedy:
        sampling = dataclasses.replace(sampling, seed=secrets.randbits(64))
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_new_tokens=max_new,
        min_new_tokens=stopping.min_new_tokens,
        stop_sequences=tuple(stopping.stop_sequences),
        stop_token_ids=frozenset(int(t) for t in stopping.stop_token_ids),
        include_stop_sequence=stopping.include_stop_sequence,
        ignore_eos=stopping.ignore_eos,
        time_limit_s=stopping.time_limit_ms / 1000 if stopping.time_limit_ms else None,
        deadline=deadline,
        tenant=tenant,
        priority=priority_of(request),
        want_tokens=output.token_ids or output.logprobs or output.top_logprobs > 0 or bool(output.logprobs_of),
        want_logprobs=output.logprobs or output.top_logprobs > 0 or bool(output.logprobs_of),
        top_logprobs=output.top_logprobs,
        # The uncut stream's first chunk carried the prompt's tokens: a resume past it does not repeat them.
        prompt_logprobs=(output.prompt_logprobs or output.prompt_top_logprobs > 0) and request.resume.next_index == 0,
        prompt_top_logprobs=output.prompt_top_logprobs,
        logprobs_of=tuple(int(t) for t in output.logprobs_of),
        arrival=arrival,
        resume_ids=resume,
        response_format=response_format(request),
        adapter=request.adapter,
    )


def samples(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The engine requests of a call's ``n`` samples (GenerateRequest.n; 0 is one): sample i samples
    with seed + i (mod 2**64), sample 0 alone scores the prompt, and the others wait for sample 0 to
    have read the prompt (``after_prompt``), to share its keys and values through the prefix cache."""
    if n <= 1:
        return [generation]
    read = threading.Event()
    seed = generation.sampling.seed
    out = [dataclasses.replace(generation, prompt_read=read)]
    for i in range(1, n):
        sampling = generation.sampling
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=(seed + i) % 2**64)
        out.append(
            dataclasses.replace(
                generation,
                sampling=sampling,
                prompt_logprobs=False,
                prompt_top_logprobs=0,
                after_prompt=read,
            )
        )
    return out


def max_new_tokens_asked(request: pb.GenerateRequest, limits: RequestLimits) -> int:
    """The completion a request asks for: its max_new_tokens, else the server's default."""
    stopping = request.stopping
    return stopping.max_new_tokens if stopping.HasField("max_new_tokens") else limits.default_max_new_tokens


def reply_too_large(size: int, limit: int, request: pb.TokenizeRequest) -> str:
    """Why a Tokenize answer is not sent, and what makes it smaller."""
    smaller = [
        name
        for name, on in (("return_tokens", request.return_tokens), ("return_offsets", request.return_offsets))
        if on
    ]
    how = f"ask without {' and '.join(smaller)}, or " if smaller else ""
    return (
        f"the answer would be {size} bytes, above the {limit} bytes this server sends in one message "
        f"(RequestLimits.max_message_bytes); {how}tokenize a shorter text in parts"
    )


def tokens(infos: Iterable[TokenInfo]) -> list[pb.Token]:
    out = []
    for info in infos:
        token = pb.Token(id=info.id, text=info.text)
        if info.logprob is not None:
            token.logprob = info.logprob
        token.top_logprobs.extend(pb.TopLogprob(id=a.id, text=a.text, logprob=a.logprob) for a in info.top)
        token.logprobs_of.extend(pb.TopLogprob(id=a.id, text=a.text, logprob=a.logprob) for a in info.named)
        out.append(token)
    return out


def usage(u: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        queue_time_ms=u.queue_time_s * 1000,
        time_to_first_token_ms=u.time_to_first_token_s * 1000,
        total_time_ms=u.total_time_s * 1000,
        cached_prompt_tokens=u.cached_prompt_tokens,
    )


def chunk(
    request_id: str,
    index: int,
    text: str,
    infos: Iterable[TokenInfo],
    reason: FinishReason | None = None,
    final_usage: Usage | None = None,
    seed: int | None = None,
    matched: str | int | None = None,
    prompt: Iterable[TokenInfo] = (),
    sample: int = 0,
) -> pb.TokenChunk:
    """One TokenChunk; the last one of a stream carries the finish reason, usage and the stop
    that ended it (``matched``), the first the seed of a request that samples and the scored
    prompt (``prompt``) of one that asked."""
    out = pb.TokenChunk(request_id=request_id, index=index, text=text, tokens=tokens(infos), sample=sample)
    out.prompt_tokens.extend(tokens(prompt))
    if seed is not None:
        out.seed = seed
    if reason is not None:
        out.finish_reason = FINISH_REASONS[reason]
    if final_usage is not None:
        out.usage.CopyFrom(usage(final_usage))
    if isinstance(matched, str):
        out.stop_sequence = matched
    elif matched is not None:
        out.stop_token_id = matched
    return out


def usage_fields(u: Usage, reason: FinishReason) -> dict[str, object]:
    """The usage as it appears on the call's log line (milliseconds, rounded)."""
    return {
        "finish_reason": reason.value,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "queue_ms": round(u.queue_time_s * 1000, 1),
        "ttft_ms": round(u.time_to_first_token_s * 1000, 1),
        "total_ms": round(u.total_time_s * 1000, 1),
    }


def prompt_for_log(request: pb.GenerateRequest | pb.TokenizeRequest) -> object:
    """The prompt as logged with --log-prompts."""
    kind = request.WhichOneof("input")
    if kind == "chat":
        return [{"role": m.role, "content": m.content} for m in request.chat.messages]
    if kind == "token_ids" and isinstance(request, pb.GenerateRequest):
        return list(request.token_ids.ids)
    if isinstance(request, pb.GenerateRequest):
        return request.prompt
    return request.text


def sampling_params(options: SamplingOptions) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        repetition_penalty=options.repetition_penalty,
    )


def model_info(description: ModelDescription) -> pb.ModelInfo:
    limits = description.limits
    info = pb.ModelInfo(
        name=description.name,
        context_length=limits.context_length,
        max_new_tokens_limit=limits.max_new_tokens_limit,
        default_max_new_tokens=limits.default_max_new_tokens,
        eos_token_ids=list(description.eos_token_ids),
        has_chat_template=description.has_chat_template,
        dtype=description.dtype,
        device=description.device,
        engine=description.engine,
        vocab_size=description.vocab_size,
        max_active_streams=description.max_active,
        max_queued_requests=description.max_queue,
        notes=list(description.notes),
        quantization=description.quantization,
        limits=pb.RequestLimits(
            max_new_tokens_limit=limits.max_new_tokens_limit,
            default_max_new_tokens=limits.default_max_new_tokens,
            max_stop_sequences=limits.max_stop_sequences,
            max_stop_sequence_chars=limits.max_stop_sequence_chars,
            max_chat_messages=limits.max_chat_messages,
            max_top_logprobs=limits.max_top_logprobs,
            max_message_bytes=limits.max_message_bytes,
            context_length=limits.context_length,
            vocab_size=limits.vocab_size,
            max_request_tokens=limits.max_request_tokens,
            max_request_id_chars=MAX_REQUEST_ID_CHARS,
            max_json_schema_depth=MAX_JSON_SCHEMA_DEPTH,
            max_format_chars=MAX_FORMAT_CHARS,
            max_quoted_chars=MAX_QUOTED_CHARS,
            max_prompt_chars=limits.max_prompt_chars,
            max_format_compile_ms=round(limits.format_compile_timeout_s * 1000),
            max_error_trailer_bytes=TRAILER_BYTES,
            max_stop_token_ids=limits.max_stop_token_ids,
            max_logit_bias=limits.max_logit_bias,
            max_logprobs_of=limits.max_logprobs_of,
            max_n=limits.max_n,
            max_loras=limits.max_loras,
            max_lora_rank=limits.max_lora_rank,
        ),
        default_sampling=sampling_params(description.default_sampling),
        adapters=[
            pb.AdapterInfo(name=a.name, rank=a.rank, target_modules=list(a.modules)) for a in description.adapters
        ],
    )
    if description.bos_token_id is not None:
        info.bos_token_id = description.bos_token_id
    return info


def tokenize_response(encoding: Encoding, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
    response = pb.TokenizeResponse(count=len(encoding.ids), ids=encoding.ids, text=encoding.text)
    if request.return_tokens:
        response.tokens.extend(encoding.tokens)
    response.offsets.extend(pb.Offset(start=s, end=e) for s, e in encoding.offsets)
    return response
