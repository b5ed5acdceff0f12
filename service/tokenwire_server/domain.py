"""The domain: plain request, event and description types shared by every room.

Nothing here imports protobuf, gRPC, torch or transformers. The transport converts
protobuf to these types and back; engines take them and produce them; the
backend seam (``backend.py``) is written in them.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from typing import Protocol


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    TIME_LIMIT = "time_limit"
    STOP_TOKEN = "stop_token"


class ErrorKind(str, enum.Enum):
    INTERNAL = "internal"  # an exception inside generation
    OUT_OF_MEMORY = "out_of_memory"  # the device ran out of memory for this request
    DEADLINE = "deadline"  # the call's deadline passed (before or during generation)
    SHUTDOWN = "shutdown"  # the engine stopped before the request finished
    HANDOFF = "handoff"  # the server drains and hands the stream off, to be resumed on another replica
    STALLED_READER = "stalled_reader"  # the caller left its stream unread for --stalled-reader-timeout
    # The response format reached a point no token of the vocabulary can continue (the
    # caller's format, e.g. a regex asking for a control character no token holds).
    FORMAT_DEAD_END = "format_dead_end"


class Priority(enum.IntEnum):
    """How urgent a request is (``GenerateRequest.priority``); a lower value is admitted first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        return self.name.lower()


DEFAULT_TENANT = "default"


# Below this a temperature is greedy: dividing logits by it overflows float32 to inf.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Most alternatives a request may ask for per token (OutputOptions.top_logprobs, prompt_top_logprobs).
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen. The neutral values here are what 'no limit' means;
    a request's unset fields take the model's defaults (``ModelDescription.default_sampling``)."""

    temperature: float = 1.0  # 0 (or below MIN_SAMPLING_TEMPERATURE): greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # OpenAI's penalties over the tokens generated so far, and min_p (0: none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    # (token id, bias) pairs, ids ascending, added to the logits first; BAN_BIAS bans the token.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Every limit the server enforces on a request, in one place (published in ModelInfo)."""

    context_length: int
    vocab_size: int
    default_max_new_tokens: int
    max_new_tokens_limit: int
    max_stop_sequences: int
    max_stop_sequence_chars: int
    max_chat_messages: int
    max_message_bytes: int
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_stop_token_ids: int = 16
    max_logit_bias: int = 300
    max_logprobs_of: int = 20
    max_n: int = 8  # GenerateRequest.n
    max_loras: int = 0  # LoRA adapters loaded at once (--max-loras)
    max_lora_rank: int = 0  # highest LoRA rank loaded (--max-lora-rank)
    # Longest prompt text, in characters, that could fit ``max_request_tokens`` (this tokenizer's
    # longest token times that); longer ones are refused before they are tokenized. 0: no bound
    # is known for this tokenizer (they are tokenized, cut one past the limit).
    max_prompt_chars: int = 0
    # Longest a response format may take to compile; past it the call is INVALID_ARGUMENT.
    format_compile_timeout_s: float = 5.0
    # Most tokens (prompt + completion) one request may hold: the context, or the KV-cache
    # budget where that is smaller (0: the context). A request that could never fit the
    # budget is refused like one that does not fit the context, never admitted over it.
    kv_cache_tokens: int = 0

    @property
    def max_request_tokens(self) -> int:
        if self.kv_cache_tokens > 0:
            return min(self.context_length, self.kv_cache_tokens)
        return self.context_length


@dataclasses.dataclass(frozen=True)
class AdapterDescription:
    """A loaded LoRA adapter, as ModelInfo lists it."""

    name: str
    rank: int
    modules: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """What the transport may know about the model being served: no tensors, no tokenizer."""

    name: str
    engine: str
    dtype: str
    device: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    default_sampling: SamplingOptions
    limits: RequestLimits
    max_active: int
    max_queue: int
    notes: tuple[str, ...] = ()
    quantization: str = "none"
    adapters: tuple[AdapterDescription, ...] = ()
    # Whether this engine applies LoRA adapters (a name not in ``adapters`` is then NOT_FOUND;
    # else a call naming one is the engine's FAILED_PRECONDITION).
    applies_adapters: bool = False

    @property
    def context_length(self) -> int:
        return self.limits.context_length


class PromptTooLong(ValueError):
    """The prompt (with the completion it asks for) does not fit the model's context."""

    def __init__(
        self, prompt_tokens: int, max_new_tokens: int, context_length: int, *, at_least: bool = False, chars: int = 0
    ) -> None:
        super().__init__(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new > context {context_length}")
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        # The prompt was not read whole (``Encoding.truncated``): it has more than
        # ``prompt_tokens`` tokens, or ``chars`` characters, more than any prompt that fits.
        self.at_least = at_least
        self.chars = chars


class InvalidResume(ValueError):
    """A resume that this request cannot continue from (``GenerateRequest.resume``)."""

    def __init__(self, message: str, field: str = "resume.generated_token_ids") -> None:
        super().__init__(message)
        self.field = field


class InvalidResponseFormat(ValueError):
    """A response format the constrained-decoding library cannot use: the message is the
    library's, ``field`` the request field (``response_format.json_schema``, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """The format an answer must follow (``GenerateRequest.response_format``).

    ``kind`` names the field that was set: ``json_schema`` (``spec`` holds the schema),
    ``json_object``, ``regex`` (the pattern), ``choice`` (``options``) or ``grammar``
    (EBNF, or Lark where no line defines a rule with ``::=``).
    """

    kind: str
    spec: str = ""
    options: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        return f"response_format.{self.kind}"


class NotSupported(ValueError):
    """A valid request this engine cannot serve (FAILED_PRECONDITION); the message says why and what to do."""


class UnknownAdapter(LookupError):
    """A request names a LoRA adapter this server has not loaded (NOT_FOUND naming ``adapter``)."""

    def __init__(self, name: str, loaded: list[str]) -> None:
        listed = ", ".join(loaded) if loaded else "none"
        super().__init__(f"adapter {name[:64]!r} is not loaded here (loaded: {listed}; ModelInfo.adapters lists them)")
        self.name = name


class InvalidAdapter(ValueError):
    """A folder LoadAdapter cannot apply to this model (INVALID_ARGUMENT naming ``path``); the
    message names the file and why."""


class AdapterExists(ValueError):
    """LoadAdapter under a name already loaded (ALREADY_EXISTS: unload it first)."""


class AdapterLimit(Exception):
    """LoadAdapter past ``--max-loras`` (RESOURCE_EXHAUSTED)."""


# What a LoRA adapter may be named (``--lora NAME=PATH``, LoadAdapterRequest.name).
ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


class EmptyPrompt(ValueError):
    """The prompt encodes to no tokens: there is nothing to continue."""


def fit_to_context(
    prompt_tokens: int, max_new_tokens: int | None, default_max_new_tokens: int, context_length: int
) -> int:
    """The context rule, in one place: how many tokens a request may generate.

    A prompt that fills the context, or an explicit ``max_new_tokens`` that does not
    fit beside the prompt, is refused (``PromptTooLong``). The server's default
    (``max_new_tokens`` unset) is clamped to what fits instead. Engines trust the
    result: a request never asks for more than the context holds.
    """
    if prompt_tokens == 0:
        raise EmptyPrompt("the prompt encodes to no tokens")
    wanted = default_max_new_tokens if max_new_tokens is None else max_new_tokens
    if prompt_tokens >= context_length or (
        max_new_tokens is not None and prompt_tokens + max_new_tokens > context_length
    ):
        raise PromptTooLong(prompt_tokens, wanted, context_length)
    return min(wanted, context_length - prompt_tokens)


@dataclasses.dataclass(frozen=True)
class TextPrompt:
    """Raw text, tokenized as is (the model's usual special tokens, no template)."""

    text: str


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered with the model's chat template and its generation prompt."""

    messages: tuple[tuple[str, str], ...]  # (role, content)


@dataclasses.dataclass(frozen=True)
class TokenPrompt:
    """Token ids, fed to the model as they are."""

    ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclasses.dataclass(frozen=True)
class Encoding:
    """A prompt as the model sees it: ids, and on request the text, offsets and token strings."""

    ids: list[int]
    text: str = ""
    offsets: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    tokens: list[str] = dataclasses.field(default_factory=list)
    # Encoded with a token bound (a Generate's prompt) and longer than it: ``ids`` is empty (the
    # text has more characters than that many tokens can hold) or cut one past the bound.
    truncated: bool = False
    chars: int = 0  # characters of the text that was (or would have been) tokenized


class NoChatTemplate(ValueError):
    """A chat was sent to a model that has no chat template."""


@dataclasses.dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingOptions
    max_new_tokens: int  # already fitted to the context (``fit_to_context``)
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    # Token ids that end the request (after min_new_tokens, whatever ignore_eos says).
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_sequence: bool = False
    ignore_eos: bool = False
    time_limit_s: float | None = None
    deadline: float | None = None  # time.monotonic() by which the call must end
    want_tokens: bool = False
    want_logprobs: bool = False
    top_logprobs: int = 0
    # Score the prompt (OutputOptions.prompt_logprobs; off for a resumed call past its first
    # chunk): each prompt token's log-probability, with this many alternatives, on the first event.
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    # Token ids whose log-probabilities every generated (and scored prompt) position reports.
    logprobs_of: tuple[int, ...] = ()
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    # A resumed stream: the tokens its caller already received. The engine reads prompt +
    # these, and goes on at step len(resume_ids) as the uncut stream would have (counts,
    # seed step, stop matcher and detokenizer state included).
    resume_ids: tuple[int, ...] = ()
    # Constrained decoding: the answer follows this format (None: free text).
    response_format: ResponseFormat | None = None
    # Who asks (from the call's credentials, never from the request) and how urgently:
    # the admission queue shares slots between tenants by weight, higher priority first.
    tenant: str = DEFAULT_TENANT
    priority: Priority = Priority.NORMAL
    # Samples of one call (GenerateRequest.n) share the prompt's reading: sample 0 sets ``prompt_read``
    # once its prompt is read (or it ends), and the others, whose ``after_prompt`` it is, wait for it
    # before they are admitted, to find its keys and values in the prefix cache. None: alone.
    prompt_read: threading.Event | None = None
    # A LoRA adapter by name (``--lora``); empty: the base model.
    adapter: str = ""
    after_prompt: threading.Event | None = None


@dataclasses.dataclass(frozen=True)
class Alternative:
    id: int
    text: str
    logprob: float


@dataclasses.dataclass(frozen=True)
class TokenInfo:
    id: int
    text: str
    logprob: float | None = None
    top: tuple[Alternative, ...] = ()
    named: tuple[Alternative, ...] = ()  # OutputOptions.logprobs_of, in the order asked


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float
    time_to_first_token_s: float
    total_time_s: float
    cached_prompt_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class TextEvent:
    """New text (and the tokens behind it) since the previous event."""

    text: str
    tokens: tuple[TokenInfo, ...] = ()
    # On a request's first event when it scores its prompt: every prompt token (the first without a logprob).
    prompt: tuple[TokenInfo, ...] = ()


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    """The last event of a request that ended normally."""

    text: str
    tokens: tuple[TokenInfo, ...]
    reason: FinishReason
    usage: Usage
    # What stopped it: the stop sequence that matched, or the stop (or end-of-sequence) token id.
    matched: str | int | None = None
    prompt: tuple[TokenInfo, ...] = ()  # as TextEvent.prompt, when this is the request's first event


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed."""

    kind: ErrorKind
    message: str


Event = TextEvent | FinishEvent | ErrorEvent
EventSink = Callable[[Event], None]


class EngineOverloaded(Exception):
    """Admission refused: active and queued requests are at their limits, or the request
    cannot start before its deadline."""

    def __init__(self, message: str, retry_after_s: float, *, deadline: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.deadline = deadline  # refused because it could not start in time


class TenantOverLimit(EngineOverloaded):
    """Admission refused for one tenant's own limit (its active or queued streams, or its
    tokens per minute); other tenants are unaffected. ``subject`` and ``limit`` name it
    for the QuotaFailure detail."""

    def __init__(self, message: str, retry_after_s: float, tenant: str, limit: str) -> None:
        super().__init__(message, retry_after_s)
        self.tenant = tenant
        self.limit = limit

    @property
    def subject(self) -> str:
        return f"tenant:{self.tenant}"


class EngineClosed(Exception):
    """The engine no longer admits requests (it is draining or stopped)."""


class EngineFaulted(EngineClosed):
    """The engine's device failed in a way that persists: nothing more can run on it, and the
    process must restart (liveness says so). The message names the fault."""


class RequestHandle:
    """The caller's side of a submitted request: cancel it, or see that it ended."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()
        self.done = threading.Event()

    def cancel(self) -> None:
        """Stop generating for this request; its slot frees within a decode step or two."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class StreamReader(Protocol):
    """The caller's side of a stream's flow control (``backend.ThreadedSubmission``): how far it
    is behind. An engine stops a stream whose reader leaves too much unread (it *parks* it) and
    asks to be woken once the reader has caught up."""

    def unread(self) -> int:
        """Events sent to the caller that it has not taken yet."""
        ...

    def last_read(self) -> float:
        """``time.monotonic()`` when the caller last took an event (when the stream opened, before any)."""
        ...

    def wake_when_read(self, down_to: int, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from any thread, maybe at once, maybe more than once) when at most
        ``down_to`` events are unread, or the caller cancels."""
        ...


class EngineObserver(Protocol):
    """What an engine reports as it works (the metrics implement it)."""

    def admitted(self, queue_wait_s: float) -> None: ...

    def prefill_step(self, seconds: float, tokens: int = 0) -> None: ...

    def decode_step(self, seconds: float) -> None: ...

    def step_host(self, seconds: float) -> None:
        """The host's own time in one decode step (``BatchedEngine._step``): its wall time, delivery
        included, less the time computing (CPU) or waiting for the device (CUDA)."""
        ...

    def preempted(self, tenant: str) -> None:
        """A running request of ``tenant`` gave up its slot to a more deserving one."""
        ...

    def parked(self, tenant: str) -> None:
        """A running request of ``tenant`` left its slot because its reader fell behind."""
        ...

    def reader_stalled(self, tenant: str) -> None:
        """A parked request of ``tenant`` ended STALLED_READER: its reader did not come back."""
        ...


class NoObserver:
    def admitted(self, queue_wait_s: float) -> None:
        pass

    def prefill_step(self, seconds: float, tokens: int = 0) -> None:
        pass

    def decode_step(self, seconds: float) -> None:
        pass

    def step_host(self, seconds: float) -> None:
        pass

    def preempted(self, tenant: str) -> None:
        pass

    def parked(self, tenant: str) -> None:
        pass

    def reader_stalled(self, tenant: str) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class TenantLoad:
    """One tenant's requests at one priority: running and waiting."""

    tenant: str
    priority: str
    active: int
    queued: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    active: int
    queued: int
    batch_size: int
    kv_tokens_reserved: int = 0
    kv_tokens_budget: int = 0
    tenants: tuple[TenantLoad, ...] = ()
    parked: int = 0  # streams out of the batch until their readers catch up (no slot, no queue place)
