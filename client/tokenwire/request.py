"""Keyword arguments in, a checked GenerateRequest / TokenizeRequest out.

The client runs the same rules as the server (``tokenwire.validation``) before it
sends anything, so a mistake is reported with the server's own message without a
round trip.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, TypedDict

from tokenwire.errors import InvalidArgument
from tokenwire.formats import ResponseFormatLike, json_object, response_format
from tokenwire.results import Message, MessageLike
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import Limits, validate_generate_request, validate_tokenize_request

__all__ = ["GenerateOptions", "build_generate_request", "build_tokenize_request", "json_options", "new_request_id"]


class GenerateOptions(TypedDict, total=False):
    """The keyword parameters of ``generate``; each mirrors a GenerateRequest field.

    Unset ones take the server's defaults.
    """

    # SamplingParams
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    # token id -> bias in [-100, 100] (-100 bans the token)
    logit_bias: Mapping[int, float]
    # StoppingCriteria
    max_new_tokens: int
    min_new_tokens: int
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    include_stop_sequence: bool
    ignore_eos: bool
    time_limit_ms: int
    # OutputOptions
    token_ids: bool
    logprobs: bool
    top_logprobs: int
    # Score the prompt (the first chunk's prompt_tokens); with max_new_tokens=0 the call only scores.
    prompt_logprobs: bool
    prompt_top_logprobs: int
    # Token ids whose log-probabilities every generated (and scored prompt) token reports.
    logprobs_of: Sequence[int]
    # Samples of the prompt in one call (each chunk's ``sample`` says which); sample i uses seed + i.
    n: int
    # Caller-chosen id, echoed in every chunk and in the server's logs.
    request_id: str
    # The format the answer follows: a JSON schema dict, a pydantic model class or a
    # tokenwire.v1.ResponseFormat (tokenwire.formats).
    response_format: ResponseFormatLike
    # "high", "normal" or "low" (or a tokenwire.v1.Priority value): admission order among
    # waiting calls; the server may cap it per tenant.
    priority: PriorityLike
    # A LoRA adapter the server has loaded, by name (ModelInfo.adapters); unset: the base model.
    adapter: str


_SAMPLING = (
    "temperature", "top_k", "top_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "min_p",
)  # fmt: skip
_STOPPING = ("max_new_tokens", "min_new_tokens", "include_stop_sequence", "ignore_eos", "time_limit_ms")
_OUTPUT = ("token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
_KNOWN = frozenset(
    (
        *_SAMPLING,
        *_STOPPING,
        *_OUTPUT,
        "stop",
        "stop_token_ids",
        "logit_bias",
        "logprobs_of",
        "request_id",
        "response_format",
        "priority",
        "n",
        "adapter",
    )
)
PriorityLike = Literal["high", "normal", "low"] | int
PRIORITIES = {"high": pb.PRIORITY_HIGH, "normal": pb.PRIORITY_UNSPECIFIED, "low": pb.PRIORITY_LOW}


def json_options(options: GenerateOptions, schema: ResponseFormatLike | None) -> GenerateOptions:
    """``generate_json``'s options: ``schema`` (None: any JSON object) as the response format."""
    if "response_format" in options:
        raise TypeError("generate_json takes the format as schema=, not response_format=")
    return {**options, "response_format": json_object() if schema is None else schema}


def new_request_id() -> str:
    """A fresh id, so that retries of one request and its errors share it."""
    return uuid.uuid4().hex


def _chat(messages: Iterable[MessageLike]) -> pb.Chat:
    chat = pb.Chat()
    for message in messages:
        m = Message.coerce(message)
        chat.messages.add(role=m.role, content=m.content)
    return chat


def build_generate_request(
    prompt: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    input_ids: Sequence[int] | None = None,
    options: GenerateOptions | None = None,
    limits: Limits | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest from one input and the keyword parameters; raises InvalidArgument
    (with the server's messages) when it breaks a rule, TypeError on a misspelt parameter."""
    options = options or {}
    unknown = sorted(set(options) - _KNOWN)
    if unknown:
        raise TypeError(f"unknown generate parameter(s): {', '.join(unknown)}")
    given = [
        name
        for name, value in (("prompt", prompt), ("messages", messages), ("input_ids", input_ids))
        if value is not None
    ]
    if len(given) > 1:
        raise TypeError(f"give only one of prompt, messages or input_ids (got {' and '.join(given)})")

    request = pb.GenerateRequest(request_id=options.get("request_id") or new_request_id())
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.chat.CopyFrom(_chat(messages))
        request.chat.SetInParent()  # an empty conversation is still "chat was sent"
    elif input_ids is not None:
        request.token_ids.ids.extend(input_ids)
        request.token_ids.SetInParent()  # an empty list is still "token_ids was sent"

    for name in _SAMPLING:
        if name in options:
            setattr(request.sampling, name, options[name])  # type: ignore[literal-required]
    for name in _STOPPING:
        if name in options:
            setattr(request.stopping, name, options[name])  # type: ignore[literal-required]
    if "stop" in options:
        stop = options["stop"]
        request.stopping.stop_sequences.extend([stop] if isinstance(stop, str) else stop)
    if "logit_bias" in options:
        request.sampling.logit_bias.update({int(k): float(v) for k, v in options["logit_bias"].items()})
    if "stop_token_ids" in options:
        request.stopping.stop_token_ids.extend(options["stop_token_ids"])
    for name in _OUTPUT:
        if name in options:
            setattr(request.output, name, options[name])  # type: ignore[literal-required]
    if "logprobs_of" in options:
        request.output.logprobs_of.extend(options["logprobs_of"])
    if "n" in options:
        request.n = options["n"]
    if options.get("adapter"):
        request.adapter = options["adapter"]
    if options.get("response_format") is not None:
        request.response_format.CopyFrom(response_format(options["response_format"]))
    if "priority" in options:
        priority = options["priority"]
        if isinstance(priority, str):
            if priority not in PRIORITIES:
                raise TypeError(
                    f"priority must be one of {', '.join(PRIORITIES)} or a tokenwire.v1.Priority, got {priority!r}"
                )
            priority = PRIORITIES[priority]
        request.priority = priority  # type: ignore[assignment]  # an unknown int is the validator's to refuse

    violations = validate_generate_request(request, limits or Limits())
    if violations:
        raise InvalidArgument.from_violations(violations, request_id=request.request_id)
    return request


def build_tokenize_request(
    text: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    return_tokens: bool = False,
    return_offsets: bool = False,
    limits: Limits | None = None,
) -> pb.TokenizeRequest:
    if text is not None and messages is not None:
        raise TypeError("give only one of text or messages")
    request = pb.TokenizeRequest(return_tokens=return_tokens, return_offsets=return_offsets)
    if text is not None:
        request.text = text
    elif messages is not None:
        request.chat.CopyFrom(_chat(messages))
        request.chat.SetInParent()
    violations = validate_tokenize_request(request, limits or Limits())
    if violations:
        raise InvalidArgument.from_violations(violations)
    return request
