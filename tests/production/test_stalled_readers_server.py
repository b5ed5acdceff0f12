"""Callers that stop reading, on a real server (tiny model, a child process, 127.0.0.1).

Issue 36, item 7: with every slot and queue place taken by streams whose clients never
read, the server kept decoding into an unbounded buffer per stream and refused everyone
else for as long as those streams lasted. Here four such streams (2,000 tokens) fill ``--max-active 2``
and ``--max-queue 2``; their clients' HTTP/2 windows are kept at about 1 KiB (no BDP
probing, ``grpc.http2.lookahead_bytes``), so gRPC's ``yield`` on the server waits after a
few chunks, as it does for any client that stops reading once its window is full.

- Each stream is parked once ``--stream-backlog-chunks`` chunks wait unread behind that
  window: ``tokenwire_parked_streams`` reaches 4, ``tokenwire_stream_parks_total`` counts
  them, and a fresh caller is served at once (the old server answered RESOURCE_EXHAUSTED).
- Cancelling a parked call frees it within 3 s.
- After ``--stalled-reader-timeout`` the others end: ``tokenwire_stalled_reader_streams_total``
  counts them, nothing stays parked, and a client that reads at last gets what was sent,
  then ABORTED naming the flag.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from production_support import long_request, scrape, short_request, value, wait_until
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

STALL_S = 4.0
BACKLOG = 8
TOKENS = 2000  # each unread stream's max_new_tokens, as in the issue
# A client whose stream window stays at ~1 KiB: the server's yield waits after a few chunks.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(params=[["--engine", "batched"], ["--engine", "simple", "--workers", "2"]], ids=["batched", "simple"])
def server(request: pytest.FixtureRequest, tiny_long_model_dir: Path) -> Iterator[ServerProcess]:
    # The 8k-context tiny model: streams of 2,000 tokens that hold a slot for tens of seconds here.
    args = [
        "--model", str(tiny_long_model_dir), *request.param, "--max-active", "2", "--max-queue", "2",
        "--stream-backlog-chunks", str(BACKLOG), "--stalled-reader-timeout", str(STALL_S), "--metrics-port", "-1",
    ]  # fmt: skip
    with ServerProcess(args) as process:
        yield process


def unread_stream(target: str, name: str) -> tuple[grpc.Channel, Any]:
    """A Generate call whose chunks this side never takes (until the test says so)."""
    channel = grpc.insecure_channel(target, options=SMALL_WINDOW)
    stub = pb_grpc.TextGenerationStub(channel)
    # Alternatives make each chunk ~100 bytes: the window holds ~10 of them.
    # No deadline: deadline-aware admission could refuse the last ones (1,000 tokens queued ahead);
    # the test cancels every call it leaves.
    call = stub.Generate(long_request(TOKENS, request_id=name, output=pb.OutputOptions(top_logprobs=5)))
    return channel, call


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return value(scrape(server), name, **labels)


def test_callers_that_stop_reading_give_their_slots_up_and_end_aborted(server: ServerProcess) -> None:
    streams = [unread_stream(server.target, f"unread-{i}") for i in range(4)]  # every slot and queue place
    try:
        assert wait_until(lambda: metric(server, "tokenwire_parked_streams") == 4, 60), server.output()
        assert metric(server, "tokenwire_active_streams") == 0
        assert metric(server, "tokenwire_queue_depth") == 0
        assert metric(server, "tokenwire_stream_parks_total", tenant="default") >= 4

        # The old server had every slot and queue place taken: RESOURCE_EXHAUSTED, for as long
        # as those streams ran. Now the caller is served at once.
        started = time.monotonic()
        with grpc.insecure_channel(server.target) as channel:
            chunks = list(pb_grpc.TextGenerationStub(channel).Generate(short_request(6), timeout=30))
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert time.monotonic() - started < 15
        assert metric(server, "tokenwire_parked_streams") == 4  # nobody read: still parked

        # A cancelled parked call is gone within 3 s (as any cancelled call).
        for _, call in streams[:2]:
            call.cancel()
        assert wait_until(lambda: metric(server, "tokenwire_parked_streams") == 2, 3)

        # The other two: nothing read for --stalled-reader-timeout, they end.
        assert wait_until(
            lambda: metric(server, "tokenwire_stalled_reader_streams_total", tenant="default") == 2, STALL_S + 30
        )
        assert metric(server, "tokenwire_parked_streams") == 0

        # A client that reads at last gets the chunks that waited for it, then ABORTED.
        _, call = streams[2]
        received = []
        with pytest.raises(grpc.RpcError) as failure:
            for chunk in call:
                received.append(chunk)
        assert failure.value.code() is grpc.StatusCode.ABORTED
        assert "stopped reading" in failure.value.details() and "--stalled-reader-timeout" in failure.value.details()
        assert BACKLOG <= len(received) < TOKENS
        assert [chunk.index for chunk in received] == list(range(len(received)))  # nothing lost on the way
        assert wait_until(
            lambda: metric(server, "tokenwire_requests_total", method="Generate", code="ABORTED") >= 1, 10
        )
    finally:
        for channel, call in streams:
            call.cancel()
            channel.close()
