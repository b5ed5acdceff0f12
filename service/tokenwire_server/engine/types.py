"""The engine's plain request and event types: no protobuf, no gRPC."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    TIME_LIMIT = "time_limit"


class ErrorKind(str, enum.Enum):
    INTERNAL = "internal"  # an exception inside generation
    OUT_OF_MEMORY = "out_of_memory"  # the device ran out of memory for this request
    DEADLINE = "deadline"  # the call's deadline passed (before or during generation)
    SHUTDOWN = "shutdown"  # the engine stopped before the request finished


# Below this a temperature is greedy: dividing logits by it overflows float32 to inf.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 (or below MIN_SAMPLING_TEMPERATURE): greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


@dataclasses.dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingOptions
    max_new_tokens: int
    min_new_tokens: int = 0
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = False
    ignore_eos: bool = False
    time_limit_s: float | None = None
    deadline: float | None = None  # time.monotonic() by which the call must end
    want_tokens: bool = False
    want_logprobs: bool = False
    top_logprobs: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)


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


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    queue_time_s: float
    time_to_first_token_s: float
    total_time_s: float


@dataclasses.dataclass(frozen=True)
class TextEvent:
    """New text (and the tokens behind it) since the previous event."""

    text: str
    tokens: tuple[TokenInfo, ...] = ()


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    """The last event of a request that ended normally."""

    text: str
    tokens: tuple[TokenInfo, ...]
    reason: FinishReason
    usage: Usage


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed."""

    kind: ErrorKind
    message: str


Event = TextEvent | FinishEvent | ErrorEvent
EventSink = Callable[[Event], None]


class EngineOverloaded(Exception):
    """Admission refused: active and queued requests are at their limits."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineClosed(Exception):
    """The engine no longer admits requests (it is draining or stopped)."""


class RequestHandle:
    """The caller's side of a submitted request: cancel it, or see that it ended."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._cancelled = threading.Event()
        self.done = threading.Event()

    def cancel(self) -> None:
        """Stop generating for this request; its slot frees within a decode step or two."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
