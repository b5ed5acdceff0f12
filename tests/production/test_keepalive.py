"""HTTP/2 keepalive: a stream that waits silently in the queue is not cut.

A client that enforces keepalive pings every second while its stream waits for the
only slot. Against a server that allows such pings (``--min-client-ping-interval-s``),
the stream waits and then completes; against one that does not (gRPC's default of
5 minutes), the same client is disconnected (GOAWAY too_many_pings). The second case
shows the first one tests something.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from production_support import long_request, short_request
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
ONE_SLOT = ["--max-active", "1", "--max-queue", "8"]
# The strict server cuts the pinging client at about its fourth ping (one allowed, then
# three strikes): some 4 s. Eight 1000-token streams ahead keep the short request waiting
# well past that on any machine (three did not always: a fast run served it at ~4 s).
BUSY_STREAMS = 8


def wait_behind_long_streams(server: ServerProcess) -> tuple[grpc.StatusCode, list[pb.TokenChunk]]:
    """Hold the only slot with BUSY_STREAMS 1000-token streams (one running, the rest queued) on one channel,
    then send a short request on a pinging channel: it waits silently in the queue behind them,
    long enough for the pinging client to send more pings than a strict server tolerates
    (gRPC closes the connection after its third early ping)."""
    with grpc.insecure_channel(server.target) as busy_channel, grpc.insecure_channel(
        server.target, options=PINGING_CLIENT
    ) as pinging:
        busy_stub = pb_grpc.TextGenerationStub(busy_channel)
        busy = [busy_stub.Generate(long_request(1000), timeout=120) for _ in range(BUSY_STREAMS)]
        next(busy[0])
        try:
            chunks = list(pb_grpc.TextGenerationStub(pinging).Generate(short_request(), timeout=120))
            return grpc.StatusCode.OK, chunks
        except grpc.RpcError as error:
            return error.code(), []  # type: ignore[attr-defined]
        finally:
            for call in busy:
                call.cancel()


def test_a_queued_stream_survives_a_client_that_pings_every_second(tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), *ONE_SLOT, "--min-client-ping-interval-s", "0.5"]
    with ServerProcess(args) as server:
        code, chunks = wait_behind_long_streams(server)
        assert code == grpc.StatusCode.OK
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        # It really waited, silently, past the point where the strict server cuts the same client.
        assert chunks[-1].usage.queue_time_ms > 4000


def test_the_same_client_is_cut_by_a_server_that_forbids_frequent_pings(tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), *ONE_SLOT, "--min-client-ping-interval-s", "300"]
    with ServerProcess(args) as server:
        code, _ = wait_behind_long_streams(server)
        assert code == grpc.StatusCode.UNAVAILABLE
