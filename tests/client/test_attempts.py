"""tokenwire.attempts on its own: each retry and resume decision, with no server, no sleep
and a clock the test moves."""

from __future__ import annotations

import grpc
import pytest
import tokenwire
from fakes import FakeRpcError
from grpc_health.v1 import health_pb2
from tokenwire import HealthStatus, RetryPolicy
from tokenwire.attempts import (
    Attempt,
    GiveUp,
    Retry,
    StreamAttempts,
    UnaryAttempts,
    health_failure,
    health_status,
)
from tokenwire.v1 import generation_pb2 as pb

# No jitter: every delay is exact.
POLICY = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.0)
HANDOFF = ("tokenwire-resume", "handoff")


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r-1", prompt="hello", **fields)


def chunk(index: int, *ids: int, seed: int | None = None, last: bool = False) -> pb.TokenChunk:
    message = pb.TokenChunk(request_id="r-1", index=index, tokens=[pb.Token(id=i, text=f"t{i}") for i in ids])
    if seed is not None:
        message.seed = seed
    if last:
        message.finish_reason = pb.FINISH_REASON_LENGTH
        message.usage.completion_tokens = 3
    return message


def unavailable(*trailing: tuple[str, str]) -> FakeRpcError:
    return FakeRpcError(grpc.StatusCode.UNAVAILABLE, "replica gone", trailing)


def stream(
    req: pb.GenerateRequest | None = None,
    *,
    resume: bool = True,
    timeout: float | None = 10.0,
    retry: RetryPolicy = POLICY,
    clock: Clock | None = None,
) -> StreamAttempts:
    return StreamAttempts(
        request() if req is None else req, resume=resume, retry=retry, timeout=timeout, clock=clock or Clock()
    )


def started(attempts: StreamAttempts) -> Attempt:
    attempt = attempts.start()
    assert isinstance(attempt, Attempt)
    return attempt


# -- before the first chunk: the call is sent again as it was ----------------------------


def test_unavailable_before_the_first_chunk_is_retried_as_it_was():
    attempts = stream()
    first = started(attempts).request
    decision = attempts.failed(unavailable(), cancelled_here=False)
    assert decision == Retry(0.1, first)
    assert not decision.request.HasField("resume")
    again = started(attempts)
    assert again.request == first and attempts.attempts == 2


def test_a_refusal_backs_off_exponentially_until_the_attempts_run_out():
    attempts = stream()
    delays = []
    for _ in range(POLICY.max_attempts):
        started(attempts)
        decision = attempts.failed(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), cancelled_here=False)
        delays.append(decision.delay if isinstance(decision, Retry) else decision)
    assert delays[:3] == pytest.approx([0.1, 0.2, 0.4])
    assert isinstance(delays[3], GiveUp) and isinstance(delays[3].error, tokenwire.Overloaded)


def test_the_pushback_trailer_sets_the_delay_and_a_negative_one_ends_the_call():
    attempts = stream()
    started(attempts)
    decision = attempts.failed(unavailable(("grpc-retry-pushback-ms", "750")), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.delay == pytest.approx(0.75)
    started(attempts)
    decision = attempts.failed(unavailable(("grpc-retry-pushback-ms", "-1")), cancelled_here=False)
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.Unavailable)


def test_a_cancelled_this_side_did_not_ask_for_is_retried_one_it_did_is_not():
    attempts = stream()
    started(attempts)
    assert isinstance(attempts.failed(FakeRpcError(grpc.StatusCode.CANCELLED), cancelled_here=False), Retry)
    started(attempts)
    decision = attempts.failed(FakeRpcError(grpc.StatusCode.CANCELLED), cancelled_here=True)
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.Cancelled)


@pytest.mark.parametrize("chunks", [0, 2])
def test_a_status_outside_the_policy_ends_the_call_with_its_typed_error(chunks):
    attempts = stream()
    started(attempts)
    for index in range(chunks):
        attempts.received(chunk(index, 10 + index))
    decision = attempts.failed(FakeRpcError(grpc.StatusCode.INTERNAL, "boom"), cancelled_here=False)
    assert isinstance(decision, GiveUp)
    assert isinstance(decision.error, tokenwire.Internal)
    assert decision.error.request_id == "r-1" and decision.error.details == "boom"


# -- after it: the stream is resumed from what arrived ------------------------------------


def test_a_handoff_resumes_from_the_tokens_received():
    attempts = stream()
    started(attempts)
    attempts.received(chunk(0, 11))
    attempts.received(chunk(1, 12))
    decision = attempts.failed(unavailable(HANDOFF), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.delay == pytest.approx(0.1)
    assert decision.request is not None
    assert list(decision.request.resume.generated_token_ids) == [11, 12]
    assert decision.request.resume.next_index == 2
    assert started(attempts).request == decision.request


def test_unavailable_after_the_first_chunk_resumes_and_never_replays():
    attempts = stream()
    started(attempts)
    attempts.received(chunk(0, 11))
    decision = attempts.failed(unavailable(), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.request is not None
    assert decision.request.HasField("resume")
    assert decision.request.resume.next_index == 1


def test_a_resume_asks_for_token_ids_and_sends_back_the_seed_the_server_chose():
    attempts = stream()
    first = started(attempts).request
    assert first.output.token_ids  # what a resume is built from
    assert not started(stream(resume=False)).request.output.token_ids  # nothing asked for under the hood
    shown = attempts.received(chunk(0, 11, seed=4242))
    assert shown.tokens == ()  # the caller did not ask for them
    decision = attempts.failed(unavailable(), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.request is not None
    assert decision.request.sampling.seed == 4242
    assert decision.request.prompt == "hello" and decision.request.request_id == "r-1"


def test_the_callers_own_seed_is_kept_on_a_resume():
    attempts = stream(request(sampling=pb.SamplingParams(seed=7)))
    started(attempts)
    attempts.received(chunk(0, 11, seed=99))  # not what a server sends: it tells the rule from an echo
    decision = attempts.failed(unavailable(), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.request is not None
    assert decision.request.sampling.seed == 7


def test_a_second_cut_resumes_from_everything_received_and_usage_counts_both():
    """A stream may move replica to replica: each resume carries all the ids so far."""
    attempts = stream()
    started(attempts)
    attempts.received(chunk(0, 11))
    attempts.failed(unavailable(HANDOFF), cancelled_here=False)
    started(attempts)
    attempts.received(chunk(1, 12))
    decision = attempts.failed(unavailable(), cancelled_here=False)
    assert isinstance(decision, Retry) and decision.request is not None
    assert list(decision.request.resume.generated_token_ids) == [11, 12]
    assert decision.request.resume.next_index == 2
    started(attempts)
    last = attempts.received(chunk(2, 13, last=True))
    assert last.usage is not None and last.usage.resumes == 2
    assert attempts.attempts == 3


@pytest.mark.parametrize(
    ("resume", "code", "cancelled_here", "raised"),
    [
        pytest.param(False, grpc.StatusCode.UNAVAILABLE, False, tokenwire.Unavailable, id="resume-off"),
        pytest.param(True, grpc.StatusCode.CANCELLED, True, tokenwire.Cancelled, id="cancelled-here"),
        # A full replica mid-stream is not one going away: no resume, and never a replay.
        pytest.param(True, grpc.StatusCode.RESOURCE_EXHAUSTED, False, tokenwire.Overloaded, id="full-is-no-cut"),
    ],
)
def test_a_started_stream_that_may_not_resume_ends_with_its_error(resume, code, cancelled_here, raised):
    attempts = stream(resume=resume)
    started(attempts)
    attempts.received(chunk(0, 11))
    decision = attempts.failed(FakeRpcError(code, "", [HANDOFF]), cancelled_here=cancelled_here)
    assert isinstance(decision, GiveUp) and isinstance(decision.error, raised)


# -- the deadline covers every attempt ---------------------------------------------------


def test_each_attempt_gets_what_is_left_of_the_deadline():
    clock = Clock()
    attempts = stream(timeout=5.0, clock=clock)
    assert started(attempts).timeout == pytest.approx(5.0)
    clock.now += 3.0
    attempts.failed(unavailable(), cancelled_here=False)
    assert started(attempts).timeout == pytest.approx(2.0)
    assert started(stream(timeout=None)).timeout is None


def test_a_wait_the_deadline_does_not_allow_ends_the_call():
    clock = Clock()
    attempts = stream(timeout=1.0, clock=clock)
    started(attempts)
    decision = attempts.failed(unavailable(("grpc-retry-pushback-ms", "2000")), cancelled_here=False)
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.Unavailable)
    started(attempts)
    clock.now += 0.95  # 0.05 s left: the 0.1 s backoff would pass it
    assert isinstance(attempts.failed(unavailable(), cancelled_here=False), GiveUp)


def test_no_attempt_starts_once_the_deadline_has_passed():
    clock = Clock()
    attempts = stream(timeout=1.0, clock=clock)
    clock.now += 1.5
    decision = attempts.start()
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.DeadlineExceeded)
    assert decision.error.request_id == "r-1" and attempts.attempts == 0


# -- unary calls and health --------------------------------------------------------------


def test_a_unary_call_is_retried_as_it_was_within_its_deadline():
    clock = Clock()
    attempts = UnaryAttempts(POLICY, 1.0, clock=clock)
    assert attempts.start() == pytest.approx(1.0)
    assert attempts.failed(unavailable()) == Retry(0.1)
    # A unary CANCELLED never comes from this side (a caller leaving raises no RpcError).
    assert attempts.start() is not None and attempts.failed(FakeRpcError(grpc.StatusCode.CANCELLED)) == Retry(0.2)
    clock.now += 0.7
    attempts.start()
    decision = attempts.failed(unavailable())  # 0.3 s left, the backoff is 0.4 s
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.Unavailable)
    assert attempts.attempts == 3


def test_a_unary_status_outside_the_policy_is_not_retried():
    attempts = UnaryAttempts(POLICY, None)
    attempts.start()
    decision = attempts.failed(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no"))
    assert isinstance(decision, GiveUp) and isinstance(decision.error, tokenwire.PermissionDenied)


def test_health_answers():
    assert health_status(health_pb2.HealthCheckResponse(status=1)) is HealthStatus.SERVING
    assert health_status(health_pb2.HealthCheckResponse(status=2)) is HealthStatus.NOT_SERVING
    assert health_status(health_pb2.HealthCheckResponse(status=0)) is HealthStatus.UNKNOWN
    assert health_failure(FakeRpcError(grpc.StatusCode.NOT_FOUND)) is HealthStatus.SERVICE_UNKNOWN
    with pytest.raises(tokenwire.Unavailable):
        health_failure(unavailable())
