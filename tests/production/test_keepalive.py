"""HTTP/2 keepalive: a stream that waits silently in the queue is not cut.

A client that enforces keepalive pings every second while its stream waits for the
only slot. Against a server that allows such pings (``--min-client-ping-interval-s``),
the stream waits and then completes; against one that does not (gRPC's default of
5 minutes), the same client is disconnected (GOAWAY too_many_pings). The second case
shows the first one tests something.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from production_support import long_request, scrape, short_request, value, wait_until
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

PINGING_CLIENT = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# The strict server cuts the pinging client at about its fourth ping (one allowed, then
# three strikes): some 4 s of the client's own 1 s ping clock, whatever the machine. The
# slot is held until HOLD_S by construction, not by a count of tokens that a faster machine
# would get through sooner: BUSY_STREAMS streams of LONG tokens on the long-context tiny
# model (8 x 8000 decode steps, minutes here) are cancelled by the test at HOLD_S.
HOLD_S = 8.0
BUSY_STREAMS = 8
LONG = 8000
# No deadlines: deadline-aware admission would refuse a call whose deadline falls before
# the estimated end of the streams ahead (the test's own timeout bounds it).
NO_DEADLINE = None


def server_args(model: Path, ping_interval_s: str) -> list[str]:
    return ["--model", str(model), "--max-active", "1", "--max-queue", str(BUSY_STREAMS),
            "--max-new-tokens-limit", str(LONG), "--kv-cache-tokens", "8192",
            "--min-client-ping-interval-s", ping_interval_s, "--metrics-port", "-1"]  # fmt: skip


def wait_behind_long_streams(server: ServerProcess) -> tuple[grpc.StatusCode, list[pb.TokenChunk]]:
    """Hold the only slot with BUSY_STREAMS long streams (one running, the rest queued) on
    one channel, then send a short request on a pinging channel: it waits silently in the
    queue behind them, and the test lets the slot go only at HOLD_S (or once the call has
    ended, cut), so the pinging client sends more pings than a strict server tolerates
    (gRPC closes the connection after its third early ping) while it waits."""
    with (
        grpc.insecure_channel(server.target) as busy_channel,
        grpc.insecure_channel(server.target, options=PINGING_CLIENT) as pinging,
    ):
        busy_stub = pb_grpc.TextGenerationStub(busy_channel)
        # One at a time into the slot, then the rest into the queue: calls on one channel are
        # not ordered, so "the first" is only the first once its chunk has come.
        busy = [busy_stub.Generate(long_request(LONG, request_id="busy-0"), timeout=NO_DEADLINE)]
        next(busy[0])
        busy += [
            busy_stub.Generate(long_request(LONG, request_id=f"busy-{i}"), timeout=NO_DEADLINE)
            for i in range(1, BUSY_STREAMS)
        ]
        # the others wait in the queue before the short request joins it, behind them
        assert wait_until(lambda: value(scrape(server), "tokenwire_queue_depth") == BUSY_STREAMS - 1, 30)
        outcome: list[tuple[grpc.StatusCode, list[pb.TokenChunk]]] = []

        def call() -> None:
            try:
                chunks = list(pb_grpc.TextGenerationStub(pinging).Generate(short_request(), timeout=NO_DEADLINE))
                outcome.append((grpc.StatusCode.OK, chunks))
            except grpc.RpcError as error:
                outcome.append((error.code(), []))  # type: ignore[attr-defined]

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        try:
            caller.join(HOLD_S)
        finally:
            for stream in busy:
                stream.cancel()
        caller.join(60)
        assert outcome, "the pinging call did not end"
        # The streams ahead held the slot until the cancel: the server ended the last of them
        # on it, unfinished (the short request was queued behind it).
        last = f"busy-{BUSY_STREAMS - 1}"
        assert wait_until(lambda: any(r.get("request_id") == last for r in server.find("request finished")), 10)
        assert [r["code"] for r in server.find("request finished") if r.get("request_id") == last] == ["CANCELLED"]
        return outcome[0]


def test_a_queued_stream_survives_a_client_that_pings_every_second(tiny_long_model_dir: Path) -> None:
    with ServerProcess(server_args(tiny_long_model_dir, "0.5")) as server:
        code, chunks = wait_behind_long_streams(server)
        assert code == grpc.StatusCode.OK
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        # It really waited, silently, past the point where the strict server cuts the same client.
        assert chunks[-1].usage.queue_time_ms > 4000


def test_the_same_client_is_cut_by_a_server_that_forbids_frequent_pings(tiny_long_model_dir: Path) -> None:
    with ServerProcess(server_args(tiny_long_model_dir, "300")) as server:
        code, _ = wait_behind_long_streams(server)
        assert code == grpc.StatusCode.UNAVAILABLE
