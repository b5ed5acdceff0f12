"""One place for what every call needs at its start and its end.

``Calls.unary`` and ``Calls.stream`` wrap an RPC handler. The wrapper gives the
call its request id (sent back in the ``x-request-id`` trailer), maps whatever
the handler raises to a deliberate gRPC status (``status.failure_of``; a bug ends
as INTERNAL, never UNKNOWN), counts the call in the metrics, keeps the count of
calls in flight that drain waits for, and writes the one "request finished" log
line, and opens and ends the call's trace span (``tracing``; a no-op unless tracing is on).
Handlers only do their RPC's own work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from tokenwire.validation import FieldViolation

from ..domain import EngineOverloaded, Usage
from ..metrics import Metrics
from ..tracing import NO_SPAN, NO_TRACING, CallSpan, Tracing
from .conversion import REQUEST_ID_METADATA, request_id
from .status import RpcFailure, failure_of, invalid_argument

log = logging.getLogger("tokenwire.requests")

DEADLINE_SKEW_S = 1.0

Request = TypeVar("Request")
Response = TypeVar("Response")
if TYPE_CHECKING:  # generic only in the type stubs
    Context = grpc.aio.ServicerContext[Any, Any]


class Undecodable:
    """A request whose bytes are not a valid message; the call ends INVALID_ARGUMENT."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error


def lenient(message_type: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer that never raises (a raise would end the call as UNKNOWN)."""

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_type.DESCRIPTOR.full_name, str(exc))

    return parse


def register(server: grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
    """Serve ``handlers`` (method name -> handler) as ``service`` on ``server``."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def check_decoded(request: object) -> None:
    if isinstance(request, Undecodable):
        raise invalid_argument([FieldViolation("request", f"is not a valid {request.type_name}: {request.error}")])


@dataclasses.dataclass
class Call:
    """What the wrapper knows of one call; handlers add to ``fields`` for the log line."""

    method: str
    request_id: str
    started: float
    input_field: str = "input"  # the request field that holds the prompt, for error details
    code: grpc.StatusCode = grpc.StatusCode.OK
    completed: bool = False
    closed: bool = False  # counted and logged (before its error status went out, for a failure)
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What the handler learns of the call, for its trace span.
    tenant: str = "default"
    priority: str = "normal"
    usage: Usage | None = None  # a Generate that finished
    reason: str = ""  # its finish reason (FinishReason's value)
    span: CallSpan = NO_SPAN


class Calls:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.in_flight = 0
        self.tracing: Tracing = NO_TRACING  # bootstrap sets it when tracing is on

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is running, at most ``timeout_s``; True when none is."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def unary(
        self, method: str, handler: Callable[[Any, Context, Call], Awaitable[Response]]
    ) -> Callable[[Any, Context], Awaitable[Response]]:
        async def run(request: Any, context: Context) -> Response:
            call = self._open(method, request, context)
            try:
                response = await handler(request, context, call)
                call.completed = True
                return response
            except BaseException as exc:
                await self._fail(call, exc, context)
                raise
            finally:
                self._close(call, context)

        return run

    def stream(
        self, method: str, handler: Callable[[Any, Context, Call], AsyncIterator[Response]]
    ) -> Callable[[Any, Context], AsyncIterator[Response]]:
        async def run(request: Any, context: Context) -> AsyncIterator[Response]:
            call = self._open(method, request, context)
            try:
                # aclosing: when grpc drops this stream (the client left), the handler's
                # own clean-up (cancelling the engine request) runs now, not at garbage collection.
                async with contextlib.aclosing(handler(request, context, call)) as responses:  # type: ignore[type-var]
                    async for response in responses:
                        yield response
                call.completed = True
            except BaseException as exc:
                await self._fail(call, exc, context)
                raise
            finally:
                self._close(call, context)

        return run

    def _open(self, method: str, request: Any, context: Context) -> Call:
        self.in_flight += 1
        own_id = getattr(request, "request_id", "") if not isinstance(request, Undecodable) else ""
        metadata = context.invocation_metadata()
        call = Call(method, request_id(own_id, metadata), time.monotonic())
        call.span = self.tracing.start_call(method, metadata, call.request_id, call.started)
        context.set_trailing_metadata(self._id_trailer(call))
        return call

    @staticmethod
    def _id_trailer(call: Call) -> tuple[tuple[str, str], ...]:
        """The ``x-request-id`` trailer; left out for an id that is not a valid metadata value
        (printable ASCII): the chunks still carry it."""
        rid = call.request_id
        return ((REQUEST_ID_METADATA, rid),) if rid.isascii() and rid.isprintable() else ()

    async def _fail(self, call: Call, exc: BaseException, context: Context) -> None:
        """Abort the call with the status ``exc`` maps to; return for what must propagate as is."""
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            call.code = grpc.StatusCode.CANCELLED  # the client left, or its deadline passed
            return
        if isinstance(exc, grpc.aio.AbortError):
            return  # aborted below already
        failure = failure_of(exc, call.input_field)
        if failure is None:
            log.exception("%s failed", call.method, extra={"request_id": call.request_id})
            failure = RpcFailure(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        elif isinstance(exc, EngineOverloaded) and exc.deadline:
            self._metrics.deadline_refusals.inc()
        call.code = failure.code
        trailers = (*failure.trailing_metadata(), *self._id_trailer(call))
        # Counted before the status goes out: a client that reads the metrics once its call
        # has failed finds the failure there.
        self._close(call, context)
        await context.abort(failure.code, failure.message, trailing_metadata=trailers)

    def _close(self, call: Call, context: Context) -> None:
        if call.closed:
            return
        call.closed = True
        self.in_flight -= 1
        code = call.code
        if code is grpc.StatusCode.OK and not call.completed:  # closed early: the client went away
            code = grpc.StatusCode.CANCELLED
        remaining = context.time_remaining()
        # The client's deadline passes first on the client, which then cancels; here the
        # same deadline ends later by the request's transit time. A cancel that close to
        # the deadline is the deadline.
        if code is grpc.StatusCode.CANCELLED and remaining is not None and remaining <= DEADLINE_SKEW_S:
            code = grpc.StatusCode.DEADLINE_EXCEEDED
        elapsed = time.monotonic() - call.started
        metrics = self._metrics
        metrics.requests.labels(call.method, code.name).inc()
        metrics.latency.labels(call.method).observe(elapsed)
        if code is grpc.StatusCode.CANCELLED and call.method == "Generate":
            metrics.cancelled.inc()
        line = {
            "request_id": call.request_id,
            "method": call.method,
            "code": code.name,
            "duration_ms": round(elapsed * 1000, 1),
        }
        line.update(call.fields)
        log.info("request finished", extra=line)
        call.span.finish(call, code)
