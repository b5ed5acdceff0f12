"""The exceptions the client raises: one class per gRPC status, all under TokenwireError.

A failed call never leaks a raw ``grpc.RpcError``: :func:`from_rpc_error` turns it into
the matching class here, parsing what the server attached to the status (the
``google.rpc.BadRequest`` field violations of an INVALID_ARGUMENT, the
``google.rpc.RetryInfo`` or ``grpc-retry-pushback-ms`` delay of a RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from tokenwire.validation import FieldViolation

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "Overloaded",
    "PermissionDenied",
    "TokenwireError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "from_rpc_error",
]

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_PUSHBACK_KEY = "grpc-retry-pushback-ms"
_REQUEST_ID_KEY = "x-request-id"


class TokenwireError(Exception):
    """A call failed. ``code`` is the gRPC status, ``details`` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(details)
        if code is not None:
            self.code = code
        self.details = details
        self.request_id = request_id
        # Seconds the server asked us to wait before trying again, when it said so.
        self.retry_after = retry_after

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.details}"
        if self.request_id:
            text += f" (request_id={self.request_id})"
        return text


class InvalidArgument(TokenwireError):
    """The request breaks a rule; ``field_violations`` names each field and why."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(
        self,
        details: str,
        *,
        field_violations: Sequence[FieldViolation] = (),
        code: grpc.StatusCode | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(details, code=code, request_id=request_id, retry_after=retry_after)
        self.field_violations: tuple[FieldViolation, ...] = tuple(field_violations)

    @classmethod
    def from_violations(cls, violations: Sequence[FieldViolation], *, request_id: str | None = None) -> InvalidArgument:
        """The error the client raises itself when its own checks reject a request."""
        details = "; ".join(str(v) for v in violations)
        return cls(details, field_violations=violations, request_id=request_id)


class FailedPrecondition(TokenwireError):
    """The model cannot do what was asked (e.g. chat without a chat template)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(TokenwireError):
    """RESOURCE_EXHAUSTED: the server is full; ``retry_after`` says when to try again."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(TokenwireError):
    """The server cannot be reached or is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(TokenwireError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TokenwireError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(TokenwireError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TokenwireError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(TokenwireError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TokenwireError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(TokenwireError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(TokenwireError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TokenwireError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TokenwireError):
    code = grpc.StatusCode.INTERNAL


class DataLoss(TokenwireError):
    code = grpc.StatusCode.DATA_LOSS


class Unknown(TokenwireError):
    code = grpc.StatusCode.UNKNOWN


_BY_CODE: dict[grpc.StatusCode, type[TokenwireError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        FailedPrecondition,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        AlreadyExists,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        DataLoss,
        Unknown,
    )
}


def error_class(code: grpc.StatusCode) -> type[TokenwireError]:
    """The exception class of a status code (TokenwireError itself for one with none)."""
    return _BY_CODE.get(code, TokenwireError)


def _status_details(trailing: Iterable[tuple[str, str | bytes]]) -> status_pb2.Status | None:
    for key, value in trailing:
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # a malformed detail must not hide the real error
                return None
            return status
    return None


def _metadata_text(trailing: Iterable[tuple[str, str | bytes]], wanted: str) -> str | None:
    for key, value in trailing:
        if key == wanted:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def from_rpc_error(error: grpc.RpcError, *, request_id: str | None = None) -> TokenwireError:
    """The TokenwireError for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``).

    ``request_id`` is the id the request was sent with; the server's ``x-request-id``
    trailer wins when it sends one.
    """
    # Both the sync error (which is also a grpc.Call) and AioRpcError expose these
    # as plain methods; anything else (a bare RpcError) reads as UNKNOWN.
    any_error: Any = error
    try:
        code: grpc.StatusCode = any_error.code()
        details: str = any_error.details() or ""
        trailing: list[tuple[str, str | bytes]] = list(any_error.trailing_metadata() or ())
    except (AttributeError, TypeError):
        code, details, trailing = grpc.StatusCode.UNKNOWN, str(error), []
    if code is None:
        code = grpc.StatusCode.UNKNOWN
    request_id = _metadata_text(trailing, _REQUEST_ID_KEY) or request_id or None

    violations: list[FieldViolation] = []
    retry_after: float | None = None
    status = _status_details(trailing)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations.extend(FieldViolation(v.field, v.description) for v in bad_request.field_violations)
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry_info = error_details_pb2.RetryInfo()
                detail.Unpack(retry_info)
                delay = retry_info.retry_delay
                retry_after = delay.seconds + delay.nanos / 1e9
    if retry_after is None:
        pushback = _metadata_text(trailing, _PUSHBACK_KEY)
        if pushback is not None:
            try:
                retry_after = int(pushback) / 1000.0
            except ValueError:
                retry_after = None

    cls = error_class(code)
    if cls is InvalidArgument:
        return InvalidArgument(details, field_violations=violations, request_id=request_id, retry_after=retry_after)
    return cls(details, code=code, request_id=request_id, retry_after=retry_after)
