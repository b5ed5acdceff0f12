"""The asyncio client: ``tokenwire.AsyncClient``, the same calls as ``Client`` on grpc.aio.

``generate`` returns an :class:`AsyncChunkStream`; leaving ``async for`` early
(``break``, an exception, the task being cancelled, the stream being garbage
collected) cancels the RPC on the server. Each call is built as ``Client``'s is
(``tokenwire.calls``) and its retries and resumes follow the same decisions
(``tokenwire.attempts``); only the I/O differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.attempts import health_failure, health_status
from tokenwire.calls import ClientBase, GenerateCall, StreamBase, UnaryCall, same_arguments
from tokenwire.errors import Unavailable
from tokenwire.formats import parse_answer
from tokenwire.results import Chunk, Completion, HealthStatus, ModelInfo, Score, Tokenization
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncChunkStream", "AsyncClient"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class _AsyncStreamCall(Protocol):
    async def read(self) -> object: ...
    def cancel(self) -> bool: ...


class AsyncChunkStream(StreamBase[_AsyncStreamCall]):
    """The chunks of one Generate call, for ``async for``; see ``ChunkStream``."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._next_message()
        except BaseException as error:
            self._read_failed(error)
            raise
        chunk = self._received(message)
        if self._done:
            await self._read_status()
        return chunk

    async def _read_status(self) -> None:
        """Read the call to its end after the last chunk (see ``ChunkStream._read_status``):
        a call dropped before its status arrives is cancelled, and the server would log
        a complete answer as CANCELLED."""
        call = self._call
        if call is None:
            return
        try:
            message = await call.read()
        except grpc.RpcError:
            return
        if message is not aio.EOF:
            call.cancel()  # a message after the last chunk: nothing more is wanted

    async def _next_message(self) -> pb.TokenChunk:
        while True:
            if self._call is None:
                self._call = self._start(self._next_attempt())
            try:
                message = await self._call.read()
            except grpc.RpcError as rpc_error:
                await asyncio.sleep(self._retry_delay(rpc_error))
                continue
            if message is aio.EOF:
                raise StopAsyncIteration
            assert isinstance(message, pb.TokenChunk)
            return message

    def cancel(self) -> None:
        """Cancel the RPC on the server (no-op once it has ended)."""
        self._done = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        if not self._done:
            self.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def text(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        return Completion.from_chunks([chunk async for chunk in self], self.request_id)


class AsyncClient(ClientBase):
    """An asyncio client of tokenwire.v1.TextGeneration; arguments as for ``Client``.

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        self._channel = (
            aio.insecure_channel(self.target, options)
            if creds is None
            else aio.secure_channel(self.target, creds, options)
        )
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._adapters = pb_grpc.AdaptersStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the channel is connected; raise Unavailable if it is not in time."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"could not connect to {self.target} within {timeout} s") from None

    @same_arguments(ClientBase._generate_call)
    def generate(self, *args: Any, **kwargs: Any) -> AsyncChunkStream:
        """Stream the completion of a prompt, a chat (``messages``) or token ids.

        Validation happens here, before anything is sent; the call starts on the
        first ``__anext__``. ``resume``: as in ``Client.generate``.
        """
        return AsyncChunkStream(*self._generate_call(*args, **kwargs).on(self._stub.Generate))

    @same_arguments(ClientBase._generate_call)
    async def generate_text(self, *args: Any, **kwargs: Any) -> Completion:
        """The whole completion at once."""
        return await self._completion(self._generate_call(*args, **kwargs))

    @same_arguments(ClientBase._chat_call)
    async def chat(self, *args: Any, **kwargs: Any) -> Completion:
        """The model's whole reply to a conversation."""
        return await self._completion(self._chat_call(*args, **kwargs))

    @same_arguments(ClientBase._json_call)
    async def generate_json(self, *args: Any, **kwargs: Any) -> Any:
        """An answer in a JSON schema (a dict or a pydantic model class; None: any JSON object),
        parsed: a pydantic instance for a model class, else the JSON value. Raises
        ``tokenwire.formats.IncompleteAnswer`` when max_new_tokens cut the answer short."""
        call, schema = self._json_call(*args, **kwargs)
        return parse_answer(await self._completion(call), schema)

    async def _completion(self, call: GenerateCall) -> Completion:
        async with AsyncChunkStream(*call.on(self._stub.Generate)) as stream:
            return await stream.text()

    async def score(self, prompt: str, continuations: Sequence[str], *, timeout: float | None = None) -> list[Score]:
        """As ``Client.score``, the continuations scored concurrently."""

        async def one(continuation: str) -> Score:
            context, whole = self._score_texts(prompt, continuation)
            context_ids = (await self.tokenize(context, timeout=timeout)).ids
            whole_ids = (await self.tokenize(whole, timeout=timeout)).ids
            completion = await self._completion(self._score_call(whole_ids, timeout))
            return Score.from_completion(completion, len(context_ids), continuation)

        return list(await asyncio.gather(*(one(c) for c in continuations)))

    async def _unary(self, rpc: Callable[..., Awaitable[_R]], call: UnaryCall[_R, _T]) -> _T:
        """As ``Client._unary``, awaiting."""
        while True:
            try:
                return call.result(await rpc(call.request, timeout=call.attempts.start(), metadata=call.metadata))
            except grpc.RpcError as rpc_error:
                delay = call.retry_delay(rpc_error)
            await asyncio.sleep(delay)

    @same_arguments(ClientBase._tokenize_call)
    async def tokenize(self, *args: Any, **kwargs: Any) -> Tokenization:
        return await self._unary(self._stub.Tokenize, self._tokenize_call(*args, **kwargs))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self._unary(self._stub.GetModelInfo, self._model_info_call(timeout))

    async def adapters(self, *, timeout: float | None = None) -> dict[str, int]:
        """The LoRA adapters the server has loaded, each with its rank (the Adapters service:
        its ``manage_adapters`` tenants; ``model_info().adapters`` is open to every caller)."""
        return await self._unary(self._adapters.ListAdapters, self._list_adapters_call(timeout))

    async def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> int:
        """Load the PEFT LoRA folder ``path`` (relative to the server's --lora-dir) as ``name``;
        its rank. Calls may name it in ``generate(..., adapter=name)`` once this returns."""
        return await self._unary(self._adapters.LoadAdapter, self._load_adapter_call(name, path, timeout))

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> int:
        """Unload ``name``: new calls naming it fail NotFound, the streams using it finish; how many run."""
        return await self._unary(self._adapters.UnloadAdapter, self._unload_adapter_call(name, timeout))

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> HealthStatus:
        """As ``Client.health``."""
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as rpc_error:
            return health_failure(rpc_error)
        return health_status(response)
