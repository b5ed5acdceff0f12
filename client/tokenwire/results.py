"""What the client hands back: small frozen dataclasses instead of protobuf messages.

Each has a ``from_proto`` that reads the generated message, so callers never need
``tokenwire.v1`` unless they want to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import Limits

__all__ = [
    "Chunk",
    "Completion",
    "FinishReason",
    "HealthStatus",
    "Message",
    "MessageLike",
    "ModelInfo",
    "Offset",
    "Token",
    "Tokenization",
    "TopLogprob",
    "Usage",
]


class FinishReason(str, Enum):
    """Why a stream ended."""

    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    TIME_LIMIT = "time_limit"
    STOP_TOKEN = "stop_token"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason | None:
        """None for FINISH_REASON_UNSPECIFIED (every chunk but the last)."""
        return _FINISH_REASONS.get(int(value))

    def __str__(self) -> str:
        return self.value


_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS: FinishReason.EOS,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    pb.FINISH_REASON_TIME_LIMIT: FinishReason.TIME_LIMIT,
    pb.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
}


def _matched_stop(chunk: pb.TokenChunk) -> str | int | None:
    kind = chunk.WhichOneof("matched_stop")
    if kind == "stop_sequence":
        return chunk.stop_sequence
    if kind == "stop_token_id":
        return int(chunk.stop_token_id)
    return None


class HealthStatus(str, Enum):
    """A grpc.health.v1 serving status."""

    UNKNOWN = "UNKNOWN"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    SERVICE_UNKNOWN = "SERVICE_UNKNOWN"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Message:
    """One message of a conversation: role is "system", "user" or "assistant"."""

    role: str
    content: str

    @classmethod
    def coerce(cls, value: MessageLike) -> Message:
        """Accept a Message, a ``{"role": ..., "content": ...}`` mapping or a (role, content) pair."""
        if isinstance(value, Message):
            return value
        if isinstance(value, Mapping):
            return cls(str(value["role"]), str(value["content"]))
        role, content = value
        return cls(str(role), str(content))


MessageLike = Message | Mapping[str, str] | tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Usage:
    """Counts and timings of one request (from the last chunk)."""

    prompt_tokens: int
    completion_tokens: int
    queue_time_ms: float
    time_to_first_token_ms: float
    total_time_ms: float
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the server's prefix cache
    resumes: int = 0  # times the client resumed this stream on another replica after a cut (tokenwire.resume)

    @classmethod
    def from_proto(cls, usage: pb.Usage) -> Usage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            queue_time_ms=usage.queue_time_ms,
            time_to_first_token_ms=usage.time_to_first_token_ms,
            total_time_ms=usage.total_time_ms,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        )


@dataclasses.dataclass(frozen=True)
class TopLogprob:
    id: int
    text: str
    logprob: float


@dataclasses.dataclass(frozen=True)
class Token:
    """A generated (or scored prompt) token; ``logprob`` only when log-probabilities were asked
    for (and never on a prompt's first token), ``logprobs_of`` those of the ids asked for."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    logprobs_of: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_proto(cls, token: pb.Token) -> Token:
        return cls(
            id=token.id,
            text=token.text,
            logprob=token.logprob if token.HasField("logprob") else None,
            top_logprobs=tuple(TopLogprob(t.id, t.text, t.logprob) for t in token.top_logprobs),
            logprobs_of=tuple(TopLogprob(t.id, t.text, t.logprob) for t in token.logprobs_of),
        )


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One step of a streamed completion. ``finish_reason``, ``usage`` and ``matched_stop`` are
    set on the last: ``matched_stop`` is the stop sequence that matched (a str), or the stop
    token id or end-of-sequence token that ended it (an int); None where no stop did.
    ``prompt_tokens``: on the first chunk of a call that asked for prompt_logprobs, the scored prompt."""

    text: str
    index: int
    request_id: str
    tokens: tuple[Token, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    matched_stop: str | int | None = None
    prompt_tokens: tuple[Token, ...] = ()
    sample: int = 0  # which sample of an n-call (GenerateRequest.n) this chunk belongs to

    @classmethod
    def from_proto(cls, chunk: pb.TokenChunk) -> Chunk:
        return cls(
            text=chunk.text,
            index=chunk.index,
            request_id=chunk.request_id,
            tokens=tuple(Token.from_proto(t) for t in chunk.tokens),
            finish_reason=FinishReason.from_proto(chunk.finish_reason),
            usage=Usage.from_proto(chunk.usage) if chunk.HasField("usage") else None,
            matched_stop=_matched_stop(chunk),
            prompt_tokens=tuple(Token.from_proto(t) for t in chunk.prompt_tokens),
            sample=chunk.sample,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (enums as their strings)."""
        return dict(_plain(self))


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole completion: the text of every chunk joined, and how it ended. Of an n-call
    (``n=``): sample 0's, with every sample's own in ``samples`` (each its text, finish and usage)."""

    text: str
    request_id: str
    finish_reason: FinishReason | None
    usage: Usage | None
    tokens: tuple[Token, ...] = ()
    chunks: int = 0
    matched_stop: str | int | None = None  # as on the last Chunk
    prompt_tokens: tuple[Token, ...] = ()  # the scored prompt (prompt_logprobs), from the first chunk
    sample: int = 0
    samples: tuple[Completion, ...] = ()  # an n-call's every sample, in order (empty for one)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk], request_id: str = "") -> Completion:
        numbers = sorted({c.sample for c in chunks})
        if len(numbers) > 1:
            each = tuple(cls._one([c for c in chunks if c.sample == n], request_id) for n in numbers)
            return dataclasses.replace(each[0], samples=each)
        return cls._one(chunks, request_id)

    @classmethod
    def _one(cls, chunks: Sequence[Chunk], request_id: str) -> Completion:
        last = chunks[-1] if chunks else None
        return cls(
            text="".join(c.text for c in chunks),
            request_id=last.request_id if last is not None and last.request_id else request_id,
            finish_reason=last.finish_reason if last is not None else None,
            usage=last.usage if last is not None else None,
            tokens=tuple(t for c in chunks for t in c.tokens),
            chunks=len(chunks),
            matched_stop=last.matched_stop if last is not None else None,
            prompt_tokens=tuple(t for c in chunks for t in c.prompt_tokens),
            sample=chunks[0].sample if chunks else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(_plain(self))


@dataclasses.dataclass(frozen=True)
class Score:
    """How likely a continuation is after a prompt (``Client.score``), lm-eval's loglikelihood:
    the continuation's tokens, each one's log-probability given everything before it, their
    sum (``logprob``) and whether each was the model's most likely token there (``is_greedy``)."""

    continuation: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    is_greedy: bool

    @property
    def logprob(self) -> float:
        return sum(self.logprobs)

    @classmethod
    def from_completion(cls, completion: Completion, context_tokens: int, continuation: str) -> Score:
        """The continuation's part of a scoring call's prompt (its tokens after ``context_tokens``)."""
        tokens = completion.prompt_tokens[context_tokens:]
        if not tokens or any(t.logprob is None or not t.top_logprobs for t in tokens):
            raise ValueError("the server sent no scores for the continuation (a server older than prompt_logprobs?)")
        return cls(
            continuation=continuation,
            token_ids=tuple(t.id for t in tokens),
            logprobs=tuple(t.logprob for t in tokens if t.logprob is not None),
            is_greedy=all(t.top_logprobs[0].id == t.id for t in tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dict(_plain(self)), "logprob": self.logprob}


@dataclasses.dataclass(frozen=True)
class Offset:
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Tokenization:
    """The tokens of a text (or of a chat rendered with the model's template)."""

    count: int
    ids: tuple[int, ...]
    text: str
    tokens: tuple[str, ...] = ()
    offsets: tuple[Offset, ...] = ()

    @classmethod
    def from_proto(cls, response: pb.TokenizeResponse) -> Tokenization:
        return cls(
            count=response.count,
            ids=tuple(response.ids),
            text=response.text,
            tokens=tuple(response.tokens),
            offsets=tuple(Offset(o.start, o.end) for o in response.offsets),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(_plain(self))


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model being served and the server's limits."""

    name: str
    context_length: int
    max_new_tokens_limit: int
    default_max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    dtype: str
    device: str
    engine: str
    vocab_size: int
    max_active_streams: int
    max_queued_requests: int
    notes: tuple[str, ...] = ()
    # Every limit the server enforces; pass it as ``Client(limits=...)`` to check requests before sending.
    limits: Limits = dataclasses.field(default_factory=Limits)
    # What unset sampling fields take on this server: temperature, top_k, top_p, repetition_penalty.
    default_sampling: dict[str, float] = dataclasses.field(default_factory=dict)
    max_stop_sequences: int | None = None
    max_stop_sequence_chars: int | None = None
    max_stop_token_ids: int | None = None
    max_logprobs_of: int | None = None
    max_chat_messages: int | None = None
    max_top_logprobs: int | None = None
    max_message_bytes: int | None = None
    # Most tokens (prompt + completion) one request may hold here: the context or the KV budget.
    max_request_tokens: int | None = None
    # What a request's values may be (None: a server older than these limits): the longest
    # request_id, the deepest json_schema, the longest format, the longest prompt text in
    # characters (0: no bound on this tokenizer), the longest a format may compile, in ms.
    max_request_id_chars: int | None = None
    max_json_schema_depth: int | None = None
    max_format_chars: int | None = None
    max_prompt_chars: int | None = None
    max_format_compile_ms: int | None = None
    # What an error reply holds at most: characters of a value it quotes, bytes of trailers.
    max_quoted_chars: int | None = None
    max_error_trailer_bytes: int | None = None
    # Weight quantization in force: "none", "int8", "int4", "fp8", or the checkpoint's own (e.g. "gptq").
    quantization: str = "none"
    # The LoRA adapters a call may name (``generate(..., adapter=NAME)``), and their ranks.
    adapters: dict[str, int] = dataclasses.field(default_factory=dict)
    max_loras: int | None = None
    max_lora_rank: int | None = None

    @classmethod
    def from_proto(cls, info: pb.ModelInfo) -> ModelInfo:
        published = info.limits if info.HasField("limits") else None
        sampling = info.default_sampling if info.HasField("default_sampling") else None
        return cls(
            name=info.name,
            context_length=info.context_length,
            max_new_tokens_limit=info.max_new_tokens_limit,
            default_max_new_tokens=info.default_max_new_tokens,
            eos_token_ids=tuple(info.eos_token_ids),
            bos_token_id=info.bos_token_id if info.HasField("bos_token_id") else None,
            has_chat_template=info.has_chat_template,
            dtype=info.dtype,
            device=info.device,
            engine=info.engine,
            vocab_size=info.vocab_size,
            max_active_streams=info.max_active_streams,
            max_queued_requests=info.max_queued_requests,
            notes=tuple(info.notes),
            limits=Limits.from_model_info(info),
            default_sampling=(
                {
                    "temperature": sampling.temperature,
                    "top_k": sampling.top_k,
                    "top_p": sampling.top_p,
                    "repetition_penalty": sampling.repetition_penalty,
                }
                if sampling is not None
                else {}
            ),
            max_stop_sequences=published.max_stop_sequences if published else None,
            max_stop_sequence_chars=published.max_stop_sequence_chars if published else None,
            max_stop_token_ids=published.max_stop_token_ids if published else None,
            max_logprobs_of=published.max_logprobs_of if published else None,
            max_chat_messages=published.max_chat_messages if published else None,
            max_top_logprobs=published.max_top_logprobs if published else None,
            max_message_bytes=published.max_message_bytes if published else None,
            max_request_tokens=published.max_request_tokens if published else None,
            **_published(
                published,
                "max_request_id_chars",
                "max_json_schema_depth",
                "max_format_chars",
                "max_prompt_chars",
                "max_format_compile_ms",
                "max_quoted_chars",
                "max_error_trailer_bytes",
            ),
            quantization=info.quantization or "none",
            adapters={adapter.name: adapter.rank for adapter in info.adapters},
            **_published(published, "max_loras", "max_lora_rank"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(_plain(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _published(limits: pb.RequestLimits | None, *names: str) -> dict[str, int | None]:
    """These limits as a server publishes them; None for each that it does not (an older server
    leaves them 0, except max_prompt_chars, whose 0 says "no bound" only beside a known depth)."""
    if limits is None or not limits.max_json_schema_depth:
        return dict.fromkeys(names)
    return {name: int(getattr(limits, name)) for name in names}
