"""The backend seam: what the transport holds, and every engine implements.

Bootstrap builds one ``GenerationBackend`` once the model is ready. The transport
sees only this protocol and the plain types of ``domain``: importing it loads
neither torch nor transformers. Operations:

- ``describe()``: the model and the server's limits, torch-free;
- ``encode()``: chat rendering and tokenizing, off the event loop;
- ``check_format()``: compile a response format (constrained decoding), off the event
  loop, or refuse it with ``InvalidResponseFormat``;
- ``submit()``: a plain request in, an async stream of plain events out
  (``Submission``), refused at once with ``EngineOverloaded``/``EngineClosed``;
- ``close()``: end what runs and free the model.

``ThreadedSubmission`` is the bridge for engines that run in their own threads:
they call its ``sink`` from any thread, the transport iterates it on the loop; a step's
events for all its streams cross to the loop in one hand-off (``handoff``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from . import handoff
from .domain import (
    AdapterDescription,
    Encoding,
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    ModelDescription,
    Prompt,
    RequestHandle,
    ResponseFormat,
)


@runtime_checkable
class Submission(Protocol):
    """One submitted request: iterate its events (the last is a FinishEvent or an
    ErrorEvent); ``cancel()`` stops it and frees its slot (a no-op once finished)."""

    def __aiter__(self) -> AsyncIterator[Event]: ...

    def cancel(self) -> None: ...

    def end(self, event: ErrorEvent) -> None:
        """End the stream now with ``event`` (the drain's hand-off): the request is
        cancelled in the engine, and the iteration yields ``event`` next and stops."""
        ...


class GenerationBackend(Protocol):
    """The seam between the gRPC layer and whatever runs the model."""

    def describe(self) -> ModelDescription: ...

    async def encode(
        self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False, max_tokens: int | None = None
    ) -> Encoding:
        """Token ids of a prompt (raises ``NoChatTemplate`` for a chat the model cannot render).
        With ``max_tokens``, a longer prompt comes back ``truncated`` (``intake``)."""
        ...

    async def check_format(self, fmt: ResponseFormat, tenant: str = "default", *, limited: bool = True) -> float | None:
        """Compile a response format, off the event loop, so that ``submit`` finds it ready; return
        the seconds compiling took (None: it was cached). Raises ``InvalidResponseFormat``, also
        when compiling takes longer than the published limit (``intake``; not ``limited``: the
        warm-up's, which also builds the compiler)."""
        ...

    def submit(self, request: GenerationRequest) -> Submission:
        """Admit a request or raise ``EngineOverloaded`` / ``EngineClosed`` before any work."""
        ...

    def stats(self) -> EngineStats: ...

    def stalled(self, timeout_s: float) -> bool:
        """True when work is pending but the engine has made no progress for ``timeout_s``."""
        ...

    def failure(self) -> str | None:
        """Why the engine can do no more work (a device fault: the process must restart), or None."""
        ...

    def stop_admission(self) -> None:
        """Drain: admit nothing new; what is queued or running goes on."""
        ...

    async def close(self) -> None:
        """End what runs, join the engine's threads, free the model."""
        ...


@runtime_checkable
class AdapterHost(Protocol):
    """A backend that loads and unloads LoRA adapters while serving (the Adapters service)."""

    def load_adapter(self, name: str, folder: Path) -> AdapterDescription:
        """Read ``folder`` and apply it to requests naming ``name`` (blocking: call it off the
        loop). Raises InvalidAdapter, AdapterExists, AdapterLimit, or NotSupported."""
        ...

    def unload_adapter(self, name: str) -> int:
        """Stop new requests from naming ``name`` (UnknownAdapter when it is not loaded); return
        the streams still running with it."""
        ...


class ThreadedSubmission:
    """Events from an engine thread, delivered on the event loop in order.

    It is also the stream's ``StreamReader``: the engine counts what it sends (``sink``), the
    iteration what the transport takes, and the difference is how far the caller is behind.
    gRPC's ``yield`` waits while the client's HTTP/2 window is full, so a client that stops
    reading stops the iteration here; the engine sees ``unread()`` grow and parks the stream
    (docs/architecture.md, "A reader that falls behind"), so this queue stays bounded.

    Events arrive on the loop through ``handoff.send`` (with the rest of the engine's step when
    it gathers them) into a plain deque, and wake the iteration through one future while it waits.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None  # the iteration waits for an event
        self.handle: RequestHandle | None = None  # set once the engine has admitted it
        self._sent = 0  # events the engine has sent (written by the engine's thread only)
        self._taken = 0  # events the transport has taken (written on the event loop only)
        self._last_read = time.monotonic()
        self._wake: tuple[int, Callable[[], None]] | None = None  # (down_to, wake): the engine waits

    def sink(self, event: Event) -> None:
        """Called by the engine, from its own thread."""
        self._sent += 1
        handoff.send(self._loop, self._arrive, event)

    def _arrive(self, event: Event) -> None:
        """On the loop: one event in, the iteration woken if it waits."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- StreamReader: what the engine asks ----------------------------------------------

    def unread(self) -> int:
        return max(0, self._sent - self._taken)  # end() adds an event of its own

    def last_read(self) -> float:
        return self._last_read

    def wake_when_read(self, down_to: int, wake: Callable[[], None]) -> None:
        self._wake = (down_to, wake)
        # The reader may have caught up (or left) between the engine's look and this call.
        if self.unread() <= down_to or (self.handle is not None and self.handle.cancelled):
            self._fire()

    def _fire(self) -> None:
        """Wake the engine once; two threads may both get here, and ``wake`` is idempotent."""
        waiting, self._wake = self._wake, None
        if waiting is not None:
            waiting[1]()

    # -- the transport's side ------------------------------------------------------------

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self._fire()  # a parked stream is dropped now, not when its stall timeout passes

    def end(self, event: ErrorEvent) -> None:
        """Called on the event loop; what the engine sends after it is never read."""
        self.cancel()
        self._arrive(event)

    async def __aiter__(self) -> AsyncIterator[Event]:
        events = self._events
        while True:
            while not events:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            event = events.popleft()
            self._taken += 1
            self._last_read = time.monotonic()
            waiting = self._wake
            if waiting is not None and self.unread() <= waiting[0]:
                self._fire()
            yield event
            if isinstance(event, FinishEvent | ErrorEvent):
                return
