"""The map from domain outcomes to gRPC statuses, with rich error details.

INVALID_ARGUMENT carries a ``google.rpc.BadRequest`` naming each bad field;
RESOURCE_EXHAUSTED carries a ``google.rpc.RetryInfo`` and the
``grpc-retry-pushback-ms`` trailer so clients back off or try another replica.
``failure_of`` is the one place where an exception becomes a status.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status
from tokenwire.validation import FieldViolation, Rule

from ..domain import (
    AdapterExists,
    AdapterLimit,
    EmptyPrompt,
    EngineClosed,
    EngineFaulted,
    EngineOverloaded,
    ErrorKind,
    InvalidAdapter,
    InvalidResponseFormat,
    InvalidResume,
    NoChatTemplate,
    NotSupported,
    PromptTooLong,
    TenantOverLimit,
    UnknownAdapter,
)

ERROR_CODES = {
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.SHUTDOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.HANDOFF: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.FORMAT_DEAD_END: grpc.StatusCode.INVALID_ARGUMENT,  # the servicer names the format's field
    # The caller stopped reading its stream and the server stopped generating for it. ABORTED:
    # "retry at a higher level" once the reader reads (it may resume from the tokens it has).
    # Not RESOURCE_EXHAUSTED (clients read that as "this server is full, try another"), not
    # UNAVAILABLE (clients retry or resume that at once, into the same stall), not CANCELLED
    # or DEADLINE_EXCEEDED (the caller neither cancelled nor ran out of time).
    ErrorKind.STALLED_READER: grpc.StatusCode.ABORTED,
}


# Error replies stay small whatever a caller sends: a status message of at most this many
# UTF-8 bytes, each BadRequest description at most DESCRIPTION_BYTES, at most MAX_VIOLATIONS of
# them. With the request id (<= 128 characters) every error's trailers stay under
# TRAILER_BYTES, half of a gRPC client's default 16 KiB hard limit on received metadata
# (past which the call would end RESOURCE_EXHAUSTED, which clients read as "server full").
MESSAGE_BYTES = 512
DESCRIPTION_BYTES = 256
MAX_VIOLATIONS = 8
TRAILER_BYTES = 8 * 1024


def bounded(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes (on a character boundary), saying so."""
    encoded = text.encode("utf-8", "replace")
    if len(encoded) <= max_bytes:
        return text
    note = f"... ({len(text)} characters)"
    return encoded[: max_bytes - len(note)].decode("utf-8", "ignore") + note


class RpcFailure(Exception):
    """A call that ends with this status; the servicer turns it into an abort."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        details: Sequence[any_pb2.Any] = (),
        trailers: Sequence[tuple[str, str]] = (),
    ) -> None:
        message = bounded(message, MESSAGE_BYTES)
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = tuple(details)
        self.trailers = tuple(trailers)

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        if not self.details:
            return self.trailers
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=list(self.details))
        return tuple(rpc_status.to_status(proto).trailing_metadata) + self.trailers


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def invalid_argument(violations: Sequence[FieldViolation]) -> RpcFailure:
    shown = [
        FieldViolation(bounded(v.field, DESCRIPTION_BYTES), bounded(v.description, DESCRIPTION_BYTES))
        for v in violations[:MAX_VIOLATIONS]
    ]
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description) for v in shown
        ]
    )
    message = "; ".join(str(v) for v in shown)
    if len(violations) > len(shown):
        message += f"; and {len(violations) - len(shown)} more"
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message, [_pack(bad_request)])


def resource_exhausted(message: str, retry_after_s: float) -> RpcFailure:
    millis = max(1, int(retry_after_s * 1000))
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=millis // 1000, nanos=(millis % 1000) * 1_000_000)
    )
    return RpcFailure(
        grpc.StatusCode.RESOURCE_EXHAUSTED, message, [_pack(retry)], [("grpc-retry-pushback-ms", str(millis))]
    )


def quota_exceeded(exc: TenantOverLimit) -> RpcFailure:
    """RESOURCE_EXHAUSTED for one tenant's own limit: RetryInfo, and a QuotaFailure naming it."""
    failure = resource_exhausted(str(exc), exc.retry_after_s)
    quota = error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject=exc.subject, description=f"{exc.limit}: {exc}")]
    )
    return RpcFailure(failure.code, failure.message, [*failure.details, _pack(quota)], failure.trailers)


def from_error(kind: ErrorKind, message: str, retry_after_s: float) -> RpcFailure:
    if kind is ErrorKind.OUT_OF_MEMORY:
        return resource_exhausted(message, retry_after_s)
    if kind is ErrorKind.HANDOFF:
        return RpcFailure(grpc.StatusCode.UNAVAILABLE, message, trailers=(HANDOFF_TRAILER,))
    return RpcFailure(ERROR_CODES[kind], message)


DRAINING = "the server is draining; retry on another replica"
HANDOFF = (
    "the server is shutting down and handed this stream off: resume it on another replica "
    "(GenerateRequest.resume with the token ids received; the tokenwire client does this itself)"
)
# On a stream ended by the hand-off: the stream may be resumed where it was cut.
HANDOFF_TRAILER = ("tokenwire-resume", "handoff")


def failure_of(exc: BaseException, input_field: str = "input") -> RpcFailure | None:
    """The status a domain exception ends a call with; None for an unexpected one (a bug)."""
    if isinstance(exc, RpcFailure):
        return exc
    if isinstance(exc, TenantOverLimit):
        return quota_exceeded(exc)
    if isinstance(exc, EngineOverloaded):
        return resource_exhausted(str(exc), exc.retry_after_s)
    if isinstance(exc, EngineFaulted):
        return RpcFailure(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry on another replica")
    if isinstance(exc, EngineClosed):
        return RpcFailure(grpc.StatusCode.UNAVAILABLE, DRAINING)
    if isinstance(exc, NoChatTemplate):
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, Rule.NO_CHAT_TEMPLATE.error())
    if isinstance(exc, NotSupported):
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, UnknownAdapter):
        return RpcFailure(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, AdapterExists):
        return RpcFailure(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    if isinstance(exc, AdapterLimit):
        return RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, InvalidAdapter):
        return invalid_argument([FieldViolation("path", str(exc))])
    if isinstance(exc, EmptyPrompt):
        return invalid_argument([FieldViolation(input_field, "encodes to no tokens: there is nothing to continue")])
    if isinstance(exc, InvalidResume | InvalidResponseFormat):
        return invalid_argument([FieldViolation(exc.field, str(exc))])
    if isinstance(exc, PromptTooLong) and exc.at_least:
        description = Rule.PROMPT_OVER_LIMIT.error(chars=exc.chars, limit=exc.context_length)
        return invalid_argument([FieldViolation(input_field, description)])
    if isinstance(exc, PromptTooLong):
        description = Rule.PROMPT_TOO_LONG.error(
            count=exc.prompt_tokens,
            value=exc.max_new_tokens,
            total=exc.prompt_tokens + exc.max_new_tokens,
            limit=exc.context_length,
        )
        return invalid_argument([FieldViolation(input_field, description)])
    return None
