"""Deadline-aware admission: will a request start before its deadline?

When a request arrives with a deadline, the engine estimates the earliest time its
first token can come, from its place in the queue and the measured step and
prefill rates. If even that earliest time is past the deadline, the request is
refused at once (RESOURCE_EXHAUSTED with RetryInfo) so the client's retry can go
to another replica, instead of waiting here and dying as DEADLINE_EXCEEDED.

The estimate is a lower bound, so the refusals are safe:

- A running request frees its slot no sooner than its *known* remaining length:
  exactly ``max_new_tokens - generated`` steps when it ignores EOS and has no stop
  sequences; ``min_new_tokens - generated`` when it must reach a minimum; otherwise
  one step (end-of-sequence or a stop sequence may come at any token).
- A request needs ``active + queued_ahead - max_active + 1`` slots to free before
  it is admitted (the ones queued ahead take the first ones). The earliest start is
  the k-th smallest of those lower bounds, times the step time.
- The step time is the smallest of the recent decode steps (a window of 32), and
  the prefill rate the largest of the recent prompt-reading rates: optimistic
  again. The KV budget is ignored (it can only delay a start further).

Error bounds: the estimate is never above the true time to first token unless
steps become faster than the fastest recent one (a batch that shrinks sharply),
by at most that ratio. It is often far below the truth (early EOS is assumed
possible at every step), so the refusal catches the hopeless cases, such as a
queue behind long ``ignore_eos`` streams, not the merely unlikely ones. Before the
first step is measured there is no estimate and nothing is refused.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

from ..domain import GenerationRequest

WINDOW = 32


def remaining_steps_lower_bound(request: GenerationRequest, generated: int) -> int:
    """The fewest decode steps before this running request can finish."""
    left = max(0, request.max_new_tokens - generated)
    if request.ignore_eos and not request.stop_sequences:
        return left
    return max(1, min(left, request.min_new_tokens - generated))


class StartEstimator:
    """Keeps recent step timings; estimates the earliest start of a new request."""

    def __init__(self) -> None:
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._prefill_rates: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    def decode_step(self, seconds: float) -> None:
        with self._lock:
            self._steps.append(seconds)

    def prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._prefill_rates.append(tokens / seconds)

    def earliest_first_token_s(
        self,
        prompt_tokens: int,
        running: Iterable[tuple[GenerationRequest, int]],
        queued_ahead: int,
        max_active: int,
    ) -> float | None:
        """Seconds from now to the earliest possible first token; None when nothing is measured yet.

        ``running``: each active request with the number of tokens it has generated.
        """
        with self._lock:
            if not self._steps:
                return None
            step = min(self._steps)
            rate = max(self._prefill_rates) if self._prefill_rates else None
        bounds = sorted(remaining_steps_lower_bound(request, generated) for request, generated in running)
        needed = len(bounds) + queued_ahead - max_active + 1
        wait_steps = bounds[needed - 1] if 0 < needed <= len(bounds) else 0
        if needed > len(bounds):  # even every running request leaving is not enough: one step each
            wait_steps = (bounds[-1] if bounds else 0) + (needed - len(bounds))
        prefill_s = prompt_tokens / rate if rate else 0.0
        return wait_steps * step + prefill_s
