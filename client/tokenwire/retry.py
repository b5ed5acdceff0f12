"""When a failed call is tried again, and after how long.

A call that the server refused before sending anything is retried as it was. A stream
that has delivered a chunk is never replayed from its start (the caller has already
seen part of an answer); it is resumed from what it received (``tokenwire.resume``),
under the same attempts and backoff. RESOURCE_EXHAUSTED (a full replica)
and UNAVAILABLE (a draining or unreachable one) are retried by default; with the
``round_robin`` policy the next attempt goes to the next replica.

A CANCELLED that this side did not ask for, before any chunk, counts as UNAVAILABLE:
the server dropped the call unanswered, which happens to a call that reaches a
replica in the moment it stops (after its drain, grpc cancels what it had not yet
handed to the servicer).
"""

from __future__ import annotations

import dataclasses
import random

import grpc

from tokenwire.errors import TokenwireError

__all__ = ["NO_RETRY", "RetryPolicy"]


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, bounded by ``max_attempts`` (1: never retry).

    When the server says how long to wait (``google.rpc.RetryInfo`` or the
    ``grpc-retry-pushback-ms`` trailer) that delay is used instead of the backoff,
    plus up to ``jitter`` of it so that refused clients do not return in lockstep;
    a negative pushback means "do not retry".
    """

    max_attempts: int = 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_codes: frozenset[grpc.StatusCode] = frozenset(
        {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")

    def backoff(
        self, attempt: int, error: TokenwireError, rng: random.Random | None = None, *, cancelled_here: bool = True
    ) -> float | None:
        """Seconds to wait before the attempt after ``attempt`` (1-based) failed with ``error``;
        None when it must not be retried. ``cancelled_here``: whether this side cancelled the
        call (if not, a CANCELLED came from the server and is retried like UNAVAILABLE)."""
        code = error.code
        if code == grpc.StatusCode.CANCELLED and not cancelled_here:
            code = grpc.StatusCode.UNAVAILABLE
        if code not in self.retry_codes or attempt >= self.max_attempts:
            return None
        uniform = (rng or random).uniform
        if error.retry_after is not None:
            if error.retry_after < 0:
                return None
            return error.retry_after * (1 + uniform(0, self.jitter))
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return max(0.0, base * uniform(1 - self.jitter, 1 + self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)
