"""What a call does after a failed attempt: the retry and resume decisions, without I/O.

``Client`` and ``AsyncClient`` do the I/O (open the call, read it, sleep); every
decision about what comes next is taken here, once for both: give up, with which
error, or wait how long and send what. Before a stream's first chunk a refused call
is sent again as it was (``tokenwire.retry``); after it, a stream cut by its replica
(UNAVAILABLE, whether it died or drained and handed the stream off with
``tokenwire-resume: handoff``, or a CANCELLED this side did not ask for) is sent again
with ``resume`` filled from the tokens received (``tokenwire.resume``). Which replica
the next attempt reaches is the channel's round_robin's choice, not this module's.

Nothing here calls grpc, sleeps or needs an event loop; the clock is a parameter, so
each decision can be checked on its own (tests/client/test_attempts.py).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from tokenwire.errors import DeadlineExceeded, TokenwireError, from_rpc_error
from tokenwire.results import Chunk, HealthStatus
from tokenwire.resume import Resumption
from tokenwire.retry import RetryPolicy
from tokenwire.v1 import generation_pb2 as pb

__all__ = [
    "Attempt",
    "Deadline",
    "GiveUp",
    "Retry",
    "StreamAttempts",
    "UnaryAttempts",
    "health_failure",
    "health_status",
]

Clock = Callable[[], float]

# grpc.health.v1.HealthCheckResponse.ServingStatus, by number.
_HEALTH_STATUS = {
    0: HealthStatus.UNKNOWN,
    1: HealthStatus.SERVING,
    2: HealthStatus.NOT_SERVING,
    3: HealthStatus.SERVICE_UNKNOWN,
}


class Deadline:
    """One budget for a call and all its retries (None: no deadline)."""

    def __init__(self, timeout: float | None, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.at = None if timeout is None else clock() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - self._clock())

    def allows(self, delay: float) -> bool:
        """Whether waiting ``delay`` seconds still leaves time for another attempt."""
        return self.at is None or self._clock() + delay < self.at


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """The call is over: raise ``error``."""

    error: TokenwireError


@dataclasses.dataclass(frozen=True)
class Retry:
    """Wait ``delay`` seconds, then start the next attempt.

    ``request``: what a stream's next attempt sends (the first request again before any
    chunk, a resume after); None for a unary call, which sends its request as it was.
    """

    delay: float
    request: pb.GenerateRequest | None = None


@dataclasses.dataclass(frozen=True)
class Attempt:
    """Start a Generate call: send ``request`` with ``timeout`` seconds (None: no deadline)."""

    request: pb.GenerateRequest
    timeout: float | None


class _Attempts:
    """The attempts of one call against its retry policy and its one deadline."""

    def __init__(
        self,
        retry: RetryPolicy,
        timeout: float | None,
        *,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.retry = retry
        self.deadline = Deadline(timeout, clock)
        self.rng = rng
        self.attempts = 0

    def _delay(self, error: TokenwireError, *, cancelled_here: bool) -> float | None:
        """The wait before another attempt; None when the policy refuses one, or when the
        wait would leave no time for it before the deadline."""
        delay = self.retry.backoff(self.attempts, error, self.rng, cancelled_here=cancelled_here)
        if delay is None or not self.deadline.allows(delay):
            return None
        return delay


class UnaryAttempts(_Attempts):
    """A unary call (Tokenize, GetModelInfo): a refused one is sent again as it was."""

    def start(self) -> float | None:
        """Count an attempt; return its timeout, what is left of the deadline."""
        self.attempts += 1
        return self.deadline.remaining()

    def failed(self, rpc_error: grpc.RpcError) -> Retry | GiveUp:
        error = from_rpc_error(rpc_error)
        delay = self._delay(error, cancelled_here=False)  # a caller leaving raises no RpcError
        return GiveUp(error) if delay is None else Retry(delay)


class StreamAttempts(_Attempts):
    """One Generate call: what each attempt sends, and what follows a failed one.

    ``received`` takes each chunk off the wire (it is what a resume is built from);
    ``failed`` decides after an attempt that ended in an error.
    """

    def __init__(
        self,
        request: pb.GenerateRequest,
        *,
        resume: bool,
        retry: RetryPolicy,
        timeout: float | None,
        rng: random.Random | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(retry, timeout, rng=rng, clock=clock)
        self.request_id = request.request_id
        self.resumption = Resumption(request, resume)
        self.request = self.resumption.request  # what the next attempt sends
        self.started = False  # a chunk has arrived: from here on, resume (never replay)

    def start(self) -> Attempt | GiveUp:
        """The next attempt, or DEADLINE_EXCEEDED when no time is left to start one."""
        remaining = self.deadline.remaining()
        if remaining == 0.0:
            return GiveUp(DeadlineExceeded("deadline exceeded before the call could start", request_id=self.request_id))
        self.attempts += 1
        return Attempt(self.request, remaining)

    def received(self, message: pb.TokenChunk) -> Chunk:
        """Take one chunk off the wire; return it as the caller sees it."""
        self.started = True
        return self.resumption.received(message)

    def failed(self, rpc_error: grpc.RpcError, *, cancelled_here: bool) -> Retry | GiveUp:
        """After an attempt that ended in ``rpc_error``. ``cancelled_here``: this side
        cancelled the call (the caller left), so it is neither retried nor resumed."""
        error = from_rpc_error(rpc_error, request_id=self.request_id)
        if self.started and not self.resumption.resumable(error, cancelled_here=cancelled_here):
            return GiveUp(error)  # part of the answer is out: only a resume may follow, never a replay
        delay = self._delay(error, cancelled_here=cancelled_here)
        if delay is None:
            return GiveUp(error)
        if self.started:
            self.request = self.resumption.resumed_request()
        return Retry(delay, self.request)


def health_status(response: Any) -> HealthStatus:
    """The status a grpc.health.v1 Check answered (the health stubs are untyped)."""
    return _HEALTH_STATUS.get(int(response.status), HealthStatus.UNKNOWN)


def health_failure(rpc_error: grpc.RpcError) -> HealthStatus:
    """What a failed health Check means: an unknown service reads as SERVICE_UNKNOWN;
    any other failure raises its TokenwireError (an unreachable server: Unavailable)."""
    error = from_rpc_error(rpc_error)
    if error.code == grpc.StatusCode.NOT_FOUND:
        return HealthStatus.SERVICE_UNKNOWN
    raise error from None
