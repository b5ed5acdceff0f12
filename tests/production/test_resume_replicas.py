"""Streams that survive a replica, over gRPC.

- Raw resume: requests are cut at a random chunk and resumed on a *fresh* server with
  ``GenerateRequest.resume``: the rest is byte-identical to the uncut stream, chunk
  indexes continue from ``next_index``, the last usage covers the whole answer; an
  unseeded sampled request is resumed with the seed its first chunk named.
- A resume that cannot be continued is INVALID_ARGUMENT naming the field.
- Replica loss: 3 replicas, 16 seeded streams (512 tokens on the tiny model, 128 on the real
  one) through the Python client (``resume`` on, its default); one replica is SIGKILLed and
  another SIGTERMed with a
  hand-off mid-run. Every stream completes with no exception, its text byte-identical to
  an undisturbed run and its chunk indexes 0..n-1 once each.
- Rolling update: the 3 replicas restarted one after another (SIGTERM, then a new process
  on the same port), a fresh batch of 8 seeded streams started before each restart while
  the earlier ones run: no stream fails, every text is byte-identical, and each process
  leaves by handing off streams of its own (--handoff-after-s), not by the grace period.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from production_support import generation_stub
from servers import ENGINE_ARGS, TEST_ENGINE, ServerProcess
from tokenwire import Client
from tokenwire.v1 import generation_pb2 as pb

from benchmarks.resume import QUESTIONS
from benchmarks.resume import requests as resume_requests

pytestmark = pytest.mark.timeout(600)

# How long a draining replica lets its streams run before it hands them off. Short: a replica
# must still have streams in flight when it hands off, and at 0.5 s the tiny model's last 118
# tokens once finished inside it (CI, 2026-12-06), so the hand-off these tests check never came.
HANDOFF_S = 0.05


def raw_requests(stops: Sequence[str]) -> list[pb.GenerateRequest]:
    """Greedy, seeded top-p, seeded top-k with a repetition penalty; chat and raw; with and
    without stops (benchmarks.resume's set); and one sampled without a seed, for which the
    server chooses one and names it on the first chunk."""
    out = [request for _, request in resume_requests(40, count=12, stops=stops)]
    out.append(
        pb.GenerateRequest(
            request_id="unseeded",
            prompt="Tell me a story.",
            sampling=pb.SamplingParams(temperature=0.9),
            stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True),
            output=pb.OutputOptions(token_ids=True),
        )
    )
    return out


def test_a_cut_stream_resumes_on_a_fresh_server_byte_identical(tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), *ENGINE_ARGS]
    with ServerProcess(args) as first:
        stub = generation_stub(first.target)
        plain = [list(stub.Generate(r, timeout=120)) for r in raw_requests([""] * 12)]
        # Stops taken from the middle of some answers, so that they match mid-stream.
        stops = []
        for i, chunks in enumerate(plain[:12]):
            text = "".join(c.text for c in chunks)
            stops.append(text[len(text) // 2 : len(text) // 2 + 3] if i % 3 == 1 and len(text) > 8 else "")
        requests = raw_requests(stops)
        uncut = [list(stub.Generate(r, timeout=120)) for r in requests]
    rng = random.Random(5)
    with ServerProcess(args) as fresh:
        stub = generation_stub(fresh.target)
        for request, chunks in zip(requests, uncut, strict=True):
            assert [c.index for c in chunks] == list(range(len(chunks)))
            if request.sampling.HasField("seed") or request.sampling.temperature == 0:
                assert not chunks[0].HasField("seed") or chunks[0].seed == request.sampling.seed
            else:
                assert chunks[0].HasField("seed")  # the server's choice, named
            cut = rng.randrange(1, len(chunks)) if len(chunks) > 1 else 0
            resumed_request = pb.GenerateRequest()
            resumed_request.CopyFrom(request)
            resumed_request.resume.generated_token_ids.extend(t.id for c in chunks[:cut] for t in c.tokens)
            resumed_request.resume.next_index = cut
            if chunks[0].HasField("seed") and not request.sampling.HasField("seed"):
                resumed_request.sampling.seed = chunks[0].seed
            rest = list(stub.Generate(resumed_request, timeout=120))
            assert [c.index for c in rest] == list(range(cut, len(chunks))), request.request_id
            assert "".join(c.text for c in rest) == "".join(c.text for c in chunks[cut:]), (request.request_id, cut)
            assert [t.id for c in rest for t in c.tokens] == [t.id for c in chunks[cut:] for t in c.tokens]
            assert rest[-1].finish_reason == chunks[-1].finish_reason
            assert rest[-1].usage.completion_tokens == chunks[-1].usage.completion_tokens
            assert rest[-1].usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_a_resume_that_cannot_continue_is_invalid_argument(tiny_model_dir: Path) -> None:
    with ServerProcess(["--model", str(tiny_model_dir), *ENGINE_ARGS, "--default-max-new-tokens", "64"]) as server:
        stub = generation_stub(server.target)
        cases = {
            "resume.generated_token_ids": pb.GenerateRequest(
                prompt="hello",
                stopping=pb.StoppingCriteria(max_new_tokens=3),
                resume=pb.Resume(generated_token_ids=[5, 6, 7, 8]),
            ),
            "resume.generated_token_ids[1]": pb.GenerateRequest(
                prompt="hello", resume=pb.Resume(generated_token_ids=[5, 10**9])
            ),
        }
        # Longer than the server's default max_new_tokens fitted to the context: past what it may generate.
        cases["resume.generated_token_ids "] = pb.GenerateRequest(
            prompt="hello", resume=pb.Resume(generated_token_ids=[5] * 65)
        )
        for field, request in cases.items():
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field.strip() in refused.value.details(), refused.value.details()


# -- the client across replicas ---------------------------------------------------------


def stream_specs(tokens: int = 256) -> list[dict[str, Any]]:
    return [
        {
            "prompt": QUESTIONS[i % len(QUESTIONS)] + f" ({i})",
            "max_new_tokens": tokens,
            "ignore_eos": True,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 1000 + i,
        }
        for i in range(16)
    ]


class Load:
    """c streams through one client, each read chunk by chunk; what each got, and any exception."""

    def __init__(self, client: Client, specs: list[dict[str, Any]]) -> None:
        self.client = client
        self.specs = specs
        self.chunks: list[list[Any]] = [[] for _ in specs]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(len(specs))]

    def _one(self, i: int) -> None:
        spec = dict(self.specs[i])
        prompt = spec.pop("prompt")
        try:
            for chunk in self.client.generate(prompt, **spec):
                self.chunks[i].append(chunk)
        except BaseException as exc:  # the test asserts there are none
            self.errors.append(exc)

    def start(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads), "a stream did not finish"

    def join_and(self, timeout: float) -> list[list[Any]]:
        """Wait for every stream; its chunks (no stream may have failed)."""
        self.join(timeout)
        assert not self.errors, self.errors
        return self.chunks

    def received(self) -> int:
        return min(len(chunks) for chunks in self.chunks)


def replicas(model_dir: Path, count: int = 3) -> list[ServerProcess]:
    return [
        ServerProcess(["--model", str(model_dir), *ENGINE_ARGS, "--handoff-after-s", str(HANDOFF_S)])
        for _ in range(count)
    ]


def check_against(load: Load, reference: list[str]) -> int:
    """Every stream complete, indexes 0..n-1 once each, text identical; returns the resumes."""
    assert not load.errors, load.errors
    resumes = 0
    for chunks, expected, spec in zip(load.chunks, reference, load.specs, strict=True):
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert "".join(c.text for c in chunks) == expected
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == spec["max_new_tokens"]
        resumes += chunks[-1].usage.resumes
    return resumes


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# Streams long enough that the cut (once every stream has 10 chunks) finds streams still running on the
# replicas it kills and drains. At 64 tokens the real model's streams on two replicas once all ended before
# the slowest stream reached chunk 10 (CI, 2026-12-06, after its steps got faster): no resume to check. At
# 128 the tiny model's streams on the drained replica once all ended within its 0.05 s before the hand-off
# (CI, 2026-12-07): no hand-off logged. At 512 a replica would have to run 50 times as fast as the slowest.
@pytest.mark.parametrize(("model", "tokens"), [("tiny", 512), pytest.param("default", 128, marks=pytest.mark.e2e)])
def test_streams_survive_a_killed_replica_and_a_handed_off_one(
    model: str, tokens: int, request: pytest.FixtureRequest
) -> None:
    if TEST_ENGINE == "vllm":
        pytest.skip("seeded sampling on vllm does not resume exactly (docs/architecture.md, the engine table)")
    folder = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "default_model_dir")
    servers = replicas(folder)
    try:
        with Client([s.target for s in servers]) as client:
            reference = [
                "".join(c.text for c in chunks) for chunks in Load(client, stream_specs(tokens)).start().join_and(600)
            ]
            load = Load(client, stream_specs(tokens)).start()
            wait_for(lambda: load.received() >= 10, 300)
            servers[0].kill()  # a replica dies: its streams resume elsewhere
            servers[1].proc.send_signal(signal.SIGTERM)  # another drains and hands its streams off
            load.join(600)
            assert check_against(load, reference) >= 2
        assert servers[1].proc.wait(30) == 0
        assert servers[1].wait_for("handing off the streams in flight")
    finally:
        for server in servers:
            server.kill()


def test_a_rolling_update_fails_no_stream(tiny_model_dir: Path) -> None:
    if TEST_ENGINE == "vllm":
        pytest.skip("seeded sampling on vllm does not resume exactly (docs/architecture.md, the engine table)")
    servers = replicas(tiny_model_dir)
    ports = [s.port for s in servers]
    # A batch: streams on every replica, round robin. 512 tokens: at 256 a replica's streams once
    # all ended between the batch's fifth chunk and the SIGTERM (CI beside a busy process,
    # 2026-12-07: chunks carry several tokens when the reader lags), so no hand-off was logged.
    specs = stream_specs(512)[:8]
    try:
        with Client([s.target for s in servers]) as client:
            reference = ["".join(c.text for c in chunks) for chunks in Load(client, specs).start().join_and(300)]
            # A fresh batch of 8 streams before each restart, the earlier batches still
            # running: streams start on a set of replicas that is being replaced, and every
            # replica is stopped with streams of its own in flight.
            loads: list[Load] = []
            for i in range(3):
                loads.append(Load(client, specs).start())
                wait_for(lambda: loads[-1].received() >= 5, 120)
                signalled = time.monotonic()
                servers[i].proc.send_signal(signal.SIGTERM)
                assert servers[i].proc.wait(HANDOFF_S + 30) == 0
                # It left by the hand-off, not by the grace period (25 s): no grace-period cut in
                # its log, and an exit far inside the grace. Not a stopwatch's HANDOFF_S + 2 s: a
                # loaded 2-core host took 2.85 s for the same exit in test_drain.
                assert servers[i].find("handing off the streams in flight")
                assert not servers[i].find("grace period over; cancelling calls in flight")
                gone_after = time.monotonic() - signalled
                assert gone_after < HANDOFF_S + 10, gone_after
                servers[i] = ServerProcess(
                    [
                        "--model",
                        str(tiny_model_dir),
                        *ENGINE_ARGS,
                        "--handoff-after-s",
                        str(HANDOFF_S),
                        "--port",
                        str(ports[i]),
                    ]
                )
            for load in loads:
                load.join(600)
            resumes = sum(check_against(load, reference) for load in loads)
            assert resumes >= 1
    finally:
        for server in servers:
            server.kill()
