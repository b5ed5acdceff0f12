"""OpenTelemetry tracing of the RPCs: one server span per call, exported over OTLP/gRPC.

Off by default, and free when off: ``NoTracing`` never imports ``opentelemetry``, and
its ``start_call`` hands back one shared span that does nothing. On when
``--otlp-endpoint`` is set, or one of the standard variables
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` is;
``OTEL_SDK_DISABLED=true`` turns it off whatever else is set. ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` name the service (``service.name`` defaults to
``tokenwire``); the other ``OTEL_EXPORTER_OTLP_*`` variables (headers, certificates,
timeout, compression) and ``OTEL_BSP_*`` reach the exporter and the batch processor as
the SDK reads them.

A call's span continues the caller's trace: a W3C ``traceparent`` (and ``tracestate``)
in its metadata becomes the server span's parent. A Generate call that finished gets
three children laid out from its ``Usage``: ``queue`` (arrival to admission),
``prefill`` (admission to the first token) and ``decode`` (first token to the last).
Each tracing has its own ``TracerProvider`` (never the global one), so a process, or a
test, may hold several.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

import grpc

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from .transport.calls import Call

log = logging.getLogger("tokenwire.tracing")

SERVICE = "tokenwire.v1.TextGeneration"
DEFAULT_SERVICE_NAME = "tokenwire"
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
NS_PER_S = 1_000_000_000

Metadata = Iterable[tuple[str, str | bytes]]


class CallSpan(Protocol):
    def finish(self, call: Call, code: grpc.StatusCode | None = None) -> None:
        """End the call's span with what the call did; ``code``: its final status (default ``call.code``)."""


class Tracing(Protocol):
    enabled: bool
    endpoint: str

    def start_call(
        self, method: str, metadata: Metadata | None, request_id: str, started: float | None = None
    ) -> CallSpan: ...
    def force_flush(self, timeout_s: float = 5.0) -> bool: ...
    def shutdown(self, timeout_s: float = 5.0) -> None: ...


class _NoSpan:
    __slots__ = ()

    def finish(self, call: Call, code: grpc.StatusCode | None = None) -> None:
        return None


NO_SPAN = _NoSpan()


class NoTracing:
    """Tracing off: nothing is imported, recorded or sent."""

    enabled = False
    endpoint = ""

    def start_call(
        self, method: str, metadata: Metadata | None, request_id: str, started: float | None = None
    ) -> CallSpan:
        return NO_SPAN

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        return None


NO_TRACING = NoTracing()


def tracing_endpoint(flag: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Where spans go: the flag, else the standard variables; None when tracing is off.

    ``""`` means "on, and the exporter reads its endpoint from the environment"."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if flag:
        return flag
    if any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES):
        return ""
    return None


def create_tracing(flag: str = "") -> Tracing:
    """The tracing the configuration asks for: ``OtlpTracing`` or the no-op ``NO_TRACING``."""
    endpoint = tracing_endpoint(flag)
    if endpoint is None:
        return NO_TRACING
    return OtlpTracing(endpoint or None)


class OtlpTracing:
    """Spans batched and exported over OTLP/gRPC to ``endpoint`` (None: from the OTEL_* variables)."""

    enabled = True

    def __init__(self, endpoint: str | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.propagators.textmap import Getter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        class MetadataGetter(Getter[Metadata]):
            """Reads a propagation header out of a call's invocation metadata (key, value) pairs."""

            def get(self, carrier: Metadata, key: str) -> list[str] | None:
                found = [v for k, v in carrier if k == key and isinstance(v, str)]
                return found or None

            def keys(self, carrier: Metadata) -> list[str]:
                return [k for k, _ in carrier]

        insecure: bool | None = None
        if endpoint is not None:
            insecure = endpoint.startswith("http://") or None  # https://: TLS; else as the variables say
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        self.endpoint = endpoint or next(
            (os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v, "").strip()), ""
        )
        detected = Resource.create()
        service = {} if _service_named() else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
        self._provider: TracerProvider = TracerProvider(
            resource=detected.merge(Resource(service)), shutdown_on_exit=False
        )
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self._provider.get_tracer("tokenwire_server")
        self._propagator = TraceContextTextMapPropagator()
        self._getter = MetadataGetter()
        self.set_span_in_context = trace.set_span_in_context
        self._server_kind = trace.SpanKind.SERVER
        self._closed = False

    def start_call(
        self, method: str, metadata: Metadata | None, request_id: str, started: float | None = None
    ) -> CallSpan:
        """The server span of a call that arrived at ``started`` (time.monotonic(); default: now),
        a child of the trace context in its ``metadata``, when there is one."""
        parent = self._propagator.extract(list(metadata or ()), getter=self._getter)
        wall_ns = time.time_ns()
        monotonic = time.monotonic()
        if started is not None:  # the wall clock at the call's arrival, through the monotonic clock
            wall_ns -= round((monotonic - started) * NS_PER_S)
            monotonic = started
        span = self.tracer.start_span(
            f"{SERVICE}/{method}",
            context=parent,
            kind=self._server_kind,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "rpc.method": method,
                "tokenwire.request_id": request_id,
            },
            start_time=wall_ns,
        )
        return _ServerSpan(self, span, wall_ns, monotonic)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export every span ended so far; False when that did not happen in time."""
        if self._closed:
            return True
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is left and stop, within ``timeout_s``: an unreachable collector
        never holds up the drain (the spans still queued are then lost)."""
        if self._closed:
            return
        self._closed = True
        worker = threading.Thread(target=self._provider.shutdown, name="tokenwire-tracing-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("tracing: spans not exported within %.1f s of shutdown were dropped", timeout_s)


def _service_named() -> bool:
    """Whether the environment names the service (OTEL_SERVICE_NAME or service.name= in
    OTEL_RESOURCE_ATTRIBUTES): then that name wins over the default."""
    if os.environ.get("OTEL_SERVICE_NAME", "").strip():
        return True
    pairs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
    return any(pair.partition("=")[0].strip() == "service.name" for pair in pairs)


class _ServerSpan:
    """One call's server span, open from the call's start to its end."""

    __slots__ = ("_monotonic", "_span", "_tracing", "_wall_ns")

    def __init__(self, tracing: OtlpTracing, span: Span, wall_ns: int, monotonic: float) -> None:
        self._tracing = tracing
        self._span = span
        self._wall_ns = wall_ns
        self._monotonic = monotonic

    def _epoch_ns(self, monotonic: float) -> int:
        """A time.monotonic() reading as epoch nanoseconds, through the wall clock read at the span's start."""
        return self._wall_ns + round((monotonic - self._monotonic) * NS_PER_S)

    def finish(self, call: Call, code: grpc.StatusCode | None = None) -> None:
        try:
            self._finish(call, call.code if code is None else code)
        except Exception:  # a span is never worth failing or wedging a call for
            log.exception("tracing: could not end the span of %s", call.method)

    def _finish(self, call: Call, code: grpc.StatusCode) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        span.set_attributes(
            {
                "tokenwire.tenant": call.tenant,
                "tokenwire.priority": call.priority,
                "rpc.grpc.status_code": int(code.value[0]),
                "tokenwire.status": code.name,
            }
        )
        if call.reason:
            span.set_attribute("tokenwire.finish_reason", call.reason)
        usage = call.usage
        if usage is not None:
            span.set_attributes(
                {
                    "tokenwire.prompt_tokens": usage.prompt_tokens,
                    "tokenwire.completion_tokens": usage.completion_tokens,
                    "tokenwire.cached_prompt_tokens": usage.cached_prompt_tokens,
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                }
            )
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
        end_ns = self._epoch_ns(time.monotonic())
        if usage is not None and call.method == "Generate":
            self._phases(call.started, usage.queue_time_s, usage.time_to_first_token_s, usage.total_time_s, end_ns)
        span.end(end_time=end_ns)

    def _phases(self, arrival: float, queue_s: float, ttft_s: float, total_s: float, end_ns: int) -> None:
        """queue, prefill and decode as children of the server span, from the call's usage
        (seconds since its arrival), each within the one before's end and the span's end."""
        tracing = self._tracing
        parent = tracing.set_span_in_context(self._span)
        start_ns = self._epoch_ns(arrival)
        marks = [start_ns]
        for offset in (queue_s, ttft_s, total_s):
            marks.append(min(end_ns, max(marks[-1], self._epoch_ns(arrival + max(0.0, offset)))))
        for name, begin, end in zip(("queue", "prefill", "decode"), marks, marks[1:], strict=False):
            child = tracing.tracer.start_span(name, context=parent, start_time=begin)
            child.end(end_time=end)
