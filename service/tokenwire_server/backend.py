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
they call its ``sink`` from any thread, the transport iterates it on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from .domain import (
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

    async def encode(self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False) -> Encoding:
        """Token ids of a prompt (raises ``NoChatTemplate`` for a chat the model cannot render)."""
        ...

    async def check_format(self, fmt: ResponseFormat) -> float | None:
        """Compile a response format, off the event loop, so that ``submit`` finds it ready; return
        the seconds compiling took (None: it was cached). Raises ``InvalidResponseFormat``."""
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


class ThreadedSubmission:
    """Events from an engine thread, delivered on the event loop in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.handle: RequestHandle | None = None  # set once the engine has admitted it

    def sink(self, event: Event) -> None:
        """Called by the engine, from its own thread."""
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def end(self, event: ErrorEvent) -> None:
        """Called on the event loop; what the engine sends after it is never read."""
        self.cancel()
        self._events.put_nowait(event)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, FinishEvent | ErrorEvent):
                return
