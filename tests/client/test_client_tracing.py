"""The client carries the caller's OpenTelemetry context to the server (W3C ``traceparent``
in the call's metadata), when the application uses OpenTelemetry; without it, nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import tokenwire
from conftest import CLIENT_DIR
from fakes import FakeServer
from tokenwire.channel import trace_metadata

pytestmark = pytest.mark.timeout(30)

trace_sdk = pytest.importorskip("opentelemetry.sdk.trace")


@pytest.fixture()
def tracer() -> Iterator[object]:
    provider = trace_sdk.TracerProvider(shutdown_on_exit=False)  # no exporter: spans stay here
    try:
        yield provider.get_tracer("test-caller")
    finally:
        provider.shutdown()


def traceparent_of(span: object) -> str:
    context = span.get_span_context()  # type: ignore[attr-defined]
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def test_sync_client_sends_the_current_span_as_traceparent(fake: FakeServer, tracer: object) -> None:
    with tokenwire.Client(fake.address, timeout=10, metadata=[("x-team", "search")]) as client:
        with tracer.start_as_current_span("caller") as span:  # type: ignore[attr-defined]
            assert client.generate_text("traced call").text == "traced call"
        expected = traceparent_of(span)
        client.generate_text("no span now")
    traced, untraced = fake.servicer.metadata[-2:]
    assert traced["traceparent"] == expected
    assert traced["x-team"] == "search"  # the caller's own metadata still goes
    assert "traceparent" not in untraced and untraced["x-team"] == "search"


def test_async_client_sends_the_current_span_as_traceparent(fake: FakeServer, tracer: object) -> None:
    async def main() -> str:
        async with tokenwire.AsyncClient(fake.address, timeout=10) as client:
            with tracer.start_as_current_span("caller") as span:  # type: ignore[attr-defined]
                chunks = [chunk async for chunk in client.generate("async traced")]
            assert "".join(c.text for c in chunks) == "async traced"
            return traceparent_of(span)

    expected = asyncio.run(asyncio.wait_for(main(), 20))
    assert fake.servicer.metadata[-1]["traceparent"] == expected


def test_trace_metadata_keeps_what_the_caller_set(tracer: object) -> None:
    own = (("authorization", "Bearer t"), ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"))
    with tracer.start_as_current_span("caller"):  # type: ignore[attr-defined]
        assert trace_metadata(own) == own  # the caller's traceparent wins
        added = dict(trace_metadata(own[:1]))
    assert added["authorization"] == "Bearer t" and added["traceparent"].startswith("00-")
    assert trace_metadata(own[:1]) == own[:1]  # no current span: nothing added


def test_without_opentelemetry_loaded_the_client_adds_nothing_and_imports_nothing(fake: FakeServer) -> None:
    probe = (
        "import sys, tokenwire\n"
        "from tokenwire.channel import trace_metadata\n"
        "md = (('authorization', 'Bearer t'),)\n"
        "assert trace_metadata(md) is md\n"
        f"assert tokenwire.Client({fake.address!r}, timeout=10).generate_text('hi').text == 'hi'\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLIENT_DIR), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "traceparent" not in fake.servicer.metadata[-1]
