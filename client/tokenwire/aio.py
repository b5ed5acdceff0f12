"""The asyncio client: ``tokenwire.AsyncClient``, the same calls as ``Client`` on grpc.aio.

``generate`` returns an :class:`AsyncChunkStream`; leaving ``async for`` early
(``break``, an exception, the task being cancelled, the stream being garbage
collected) cancels the RPC on the server. Retries and resumes follow the same decisions
as ``Client``'s (``tokenwire.attempts``); only the waiting differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.attempts import GiveUp, health_failure, health_status
from tokenwire.channel import trace_metadata
from tokenwire.client import _ClientBase, _StreamBase
from tokenwire.errors import TokenwireError, Unavailable
from tokenwire.formats import ResponseFormatLike, parse_answer
from tokenwire.request import GenerateOptions, build_tokenize_request, json_options
from tokenwire.results import Chunk, Completion, HealthStatus, MessageLike, ModelInfo, Tokenization
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["AsyncChunkStream", "AsyncClient"]

_T = TypeVar("_T")


class _AsyncStreamCall(Protocol):
    async def read(self) -> object: ...
    def cancel(self) -> bool: ...


class AsyncChunkStream(_StreamBase[_AsyncStreamCall]):
    """The chunks of one Generate call, for ``async for``; see ``ChunkStream``."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._next_message()
        except (StopAsyncIteration, TokenwireError):
            self._done = True
            raise
        except BaseException:
            # asyncio.CancelledError, KeyboardInterrupt, ...: the RPC goes with the caller.
            self.cancel()
            raise
        chunk = self._attempts.received(message)
        if chunk.finish_reason is not None:
            self._done = True
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
                attempt = self._attempts.start()
                if isinstance(attempt, GiveUp):
                    raise attempt.error
                self._call = self._start(attempt)
            try:
                message = await self._call.read()
            except grpc.RpcError as rpc_error:
                decision = self._attempts.failed(rpc_error, cancelled_here=self._done)  # see ChunkStream
                if isinstance(decision, GiveUp):
                    raise decision.error from None
                self._call = None
                await asyncio.sleep(decision.delay)
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


class AsyncClient(_ClientBase):
    """An asyncio client of tokenwire.v1.TextGeneration; arguments as for ``Client``.

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        self._channel = (
            aio.insecure_channel(self.target, options) if creds is None else aio.secure_channel(self.target, creds, options)
        )
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

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

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> AsyncChunkStream:
        """Stream the completion of a prompt, a chat (``messages``) or token ids.

        Validation happens here, before anything is sent; the call starts on the
        first ``__anext__``. ``resume``: as in ``Client.generate``.
        """
        return AsyncChunkStream(*self._generate_call(self._stub.Generate, prompt, messages, input_ids, timeout, resume, params))

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Completion:
        """The whole completion at once."""
        stream = self.generate(prompt, messages=messages, input_ids=input_ids, timeout=timeout, resume=resume, **params)
        async with stream:
            return await stream.text()

    async def chat(
        self,
        messages: Iterable[MessageLike],
        *,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Completion:
        """The model's whole reply to a conversation."""
        return await self.generate_text(messages=messages, timeout=timeout, resume=resume, **params)


    async def generate_json(
        self,
        prompt: str | None = None,
        *,
        schema: ResponseFormatLike | None = None,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Any:
        """An answer in a JSON schema (a dict or a pydantic model class; None: any JSON object),
        parsed: a pydantic instance for a model class, else the JSON value. Raises
        ``tokenwire.formats.IncompleteAnswer`` when max_new_tokens cut the answer short."""
        completion = await self.generate_text(
            prompt, messages=messages, input_ids=input_ids, timeout=timeout, resume=resume, **json_options(params, schema)
        )
        return parse_answer(completion, schema)

    async def _unary(self, call: Callable[[float | None], Awaitable[_T]], timeout: float | None) -> _T:
        attempts = self._unary_attempts(timeout)
        while True:
            try:
                return await call(attempts.start())
            except grpc.RpcError as rpc_error:
                decision = attempts.failed(rpc_error)
                if isinstance(decision, GiveUp):
                    raise decision.error from None
            await asyncio.sleep(decision.delay)

    async def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        return_tokens: bool = False,
        return_offsets: bool = False,
        timeout: float | None = None,
    ) -> Tokenization:
        request = build_tokenize_request(
            text, messages=messages, return_tokens=return_tokens, return_offsets=return_offsets,
            limits=self.limits,
        )
        metadata = trace_metadata(self._metadata)

        async def call(t: float | None) -> pb.TokenizeResponse:
            return await self._stub.Tokenize(request, timeout=t, metadata=metadata)

        return Tokenization.from_proto(await self._unary(call, timeout))

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        metadata = trace_metadata(self._metadata)

        async def call(t: float | None) -> pb.ModelInfo:
            return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t, metadata=metadata)

        return ModelInfo.from_proto(await self._unary(call, timeout))

    async def health(self, service: str = "", *, timeout: float | None = 5.0) -> HealthStatus:
        """As ``Client.health``."""
        try:
            response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as rpc_error:
            return health_failure(rpc_error)
        return health_status(response)
