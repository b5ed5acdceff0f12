"""The asyncio client: ``tokenwire.AsyncClient``, the same calls as ``Client`` on grpc.aio.

``generate`` returns an :class:`AsyncChunkStream`; leaving ``async for`` early
(``break``, an exception, the task being cancelled, the stream being garbage
collected) cancels the RPC on the server.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.channel import TLSConfig, channel_options, credentials, resolve_target, trace_metadata
from tokenwire.client import _HEALTH_STATUS, DEFAULT_TARGET, Deadline, Metadata
from tokenwire.errors import TokenwireError, Unavailable, from_rpc_error
from tokenwire.formats import ResponseFormatLike, parse_answer
from tokenwire.request import GenerateOptions, build_generate_request, build_tokenize_request, json_options
from tokenwire.results import Chunk, Completion, HealthStatus, MessageLike, ModelInfo, Tokenization
from tokenwire.resume import Resumption
from tokenwire.retry import RetryPolicy
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire.validation import Limits

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["AsyncChunkStream", "AsyncClient"]

_T = TypeVar("_T")


class _AsyncStreamCall(Protocol):
    async def read(self) -> object: ...
    def cancel(self) -> bool: ...


class AsyncChunkStream:
    """The chunks of one Generate call, for ``async for``; see ``ChunkStream``."""

    def __init__(
        self,
        start: Callable[[float | None, pb.GenerateRequest], _AsyncStreamCall],
        *,
        resumption: Resumption,
        request_id: str,
        retry: RetryPolicy,
        deadline: Deadline,
        rng: random.Random | None = None,
    ) -> None:
        self.request_id = request_id
        self._start = start
        self._resumption = resumption
        self._request = resumption.request  # what the next attempt sends
        self._retry = retry
        self._deadline = deadline
        self._rng = rng
        self._call: _AsyncStreamCall | None = None
        self._started = False
        self._done = False
        self.attempts = 0

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._next_message()
        except StopAsyncIteration:
            self._done = True
            raise
        except TokenwireError:
            self._done = True
            raise
        except BaseException:
            # asyncio.CancelledError, KeyboardInterrupt, ...: the RPC goes with the caller.
            self.cancel()
            raise
        chunk = self._resumption.received(message)
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
                if self._deadline.remaining() == 0.0:
                    raise self._deadline.expired_error(self.request_id)
                self.attempts += 1
                self._call = self._start(self._deadline.remaining(), self._request)
            try:
                message = await self._call.read()
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error, request_id=self.request_id)
                # Before the first chunk a refused call is tried again as it was; after it, a
                # stream cut by its replica is resumed from what has arrived (tokenwire.resume).
                resume = self._started and self._resumption.resumable(error, cancelled_here=self._done)
                delay = (
                    self._retry.backoff(self.attempts, error, self._rng, cancelled_here=self._done)
                    if resume or not self._started
                    else None
                )
                if delay is None or not self._deadline.allows(delay):
                    raise error from None
                self._call = None
                await asyncio.sleep(delay)
                if resume:
                    self._request = self._resumption.resumed_request()
                continue
            if message is aio.EOF:
                raise StopAsyncIteration
            assert isinstance(message, pb.TokenChunk)
            self._started = True
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

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.cancel()
            except Exception:  # pragma: no cover - e.g. the event loop is already closed
                pass

    async def text(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        return Completion.from_chunks([chunk async for chunk in self], self.request_id)


class AsyncClient:
    """An asyncio client of tokenwire.v1.TextGeneration; arguments as for ``Client``.

    Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        tls: bool | TLSConfig = False,
        token: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        limits: Limits | None = None,
        metadata: Metadata = (),
        options: Sequence[tuple[str, str | int]] = (),
    ) -> None:
        self.target = resolve_target(target)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.limits = limits or Limits()
        creds = credentials(tls)
        opts = channel_options(tls=tls, extra=options)
        if creds is None:
            self._channel = aio.insecure_channel(self.target, options=opts)
        else:
            self._channel = aio.secure_channel(self.target, creds, options=opts)
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata: tuple[tuple[str, str], ...] = (*auth, *metadata)

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
        request = build_generate_request(
            prompt, messages=messages, input_ids=input_ids, options=params, limits=self.limits
        )
        metadata = trace_metadata(self._metadata)  # the caller's trace context, as of this call

        def start(remaining: float | None, message: pb.GenerateRequest) -> _AsyncStreamCall:
            return self._stub.Generate(message, timeout=remaining, metadata=metadata)

        deadline = Deadline(self.timeout if timeout is None else timeout)
        return AsyncChunkStream(
            start,
            resumption=Resumption(request, resume),
            request_id=request.request_id,
            retry=self.retry,
            deadline=deadline,
        )

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
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await call(deadline.remaining())
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                delay = self.retry.backoff(attempt, error, cancelled_here=False)  # a caller leaving raises no RpcError
                if delay is None or not deadline.allows(delay):
                    raise error from None
            await asyncio.sleep(delay)

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
            error = from_rpc_error(rpc_error)
            if error.code == grpc.StatusCode.NOT_FOUND:
                return HealthStatus.SERVICE_UNKNOWN
            raise error from None
        return _HEALTH_STATUS.get(int(response.status), HealthStatus.UNKNOWN)
