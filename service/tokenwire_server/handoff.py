"""Events from engine threads to event loops: one hand-off per engine step, not one per event.

An engine thread sends each stream's events to its sink (``backend.ThreadedSubmission.sink``),
which must reach the stream's event loop; ``loop.call_soon_threadsafe`` is the only safe way
across, and it costs a lock, a deque append and a write to the loop's self-pipe (a wake-up of
its selector) per call. Inside ``gathered()`` the sinks on that thread append to a per-thread
outbox instead, and when the outermost ``gathered()`` ends each loop gets its share in one
``call_soon_threadsafe``: a batched step's 16 rows cross in one call. Outside it (the simple
engine's one token per call, a submit that ends at once, a shutdown) an event crosses at once.

Order is kept: a stream's events are sent by one thread at a time, in order, and the outbox
keeps their order; a loop runs its callbacks in the order they were scheduled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["gathered", "send"]


class _Outbox(threading.local):
    depth = 0  # gathered() calls open on this thread

    def __init__(self) -> None:
        self.pending: dict[asyncio.AbstractEventLoop, list[tuple[Callable[[Any], None], Any]]] = {}


_outbox = _Outbox()


def send(loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None], event: Any) -> None:
    """Have ``loop`` call ``deliver(event)``: with this thread's others at the end of ``gathered()``
    when one is open, else now."""
    outbox = _outbox
    if outbox.depth:
        outbox.pending.setdefault(loop, []).append((deliver, event))
    else:
        loop.call_soon_threadsafe(deliver, event)


@contextlib.contextmanager
def gathered() -> Iterator[None]:
    """Hold this thread's events for event loops until the block ends, then hand each loop its
    events in one call (also when the block raises). Nestable: the outermost block hands over.

    NOTE: an engine must not wait (for the device, for work) inside the block: what it holds
    reaches nobody meanwhile. The engines wrap one step each (its deliveries, the finishes and
    failures of its rows), so a step's events are late by at most the rest of that step's host
    work; a block around waits would need a flush before each."""
    outbox = _outbox
    outbox.depth += 1
    try:
        yield
    finally:
        outbox.depth -= 1
        if not outbox.depth and outbox.pending:
            pending, outbox.pending = outbox.pending, {}
            failed: RuntimeError | None = None
            for loop, items in pending.items():
                try:
                    loop.call_soon_threadsafe(_deliver_all, items)
                except RuntimeError as exc:  # a closed loop: raised to the engine as a send would be
                    failed = failed or exc
            if failed is not None:
                raise failed


def _deliver_all(items: list[tuple[Callable[[Any], None], Any]]) -> None:
    """On the loop: every event of one hand-off, in the order sent."""
    for deliver, event in items:
        deliver(event)
