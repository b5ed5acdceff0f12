"""The blocking client: ``tokenwire.Client``.

``generate`` returns a :class:`ChunkStream`, an iterator of :class:`Chunk` that owns
its RPC: leaving the loop early (``break``, an exception, the stream being garbage
collected) cancels the call on the server. Until the first chunk arrives a refused
call is retried per the :class:`RetryPolicy`; after it, a stream that its replica cuts
(UNAVAILABLE: it died, or drained and handed the stream off) is resumed on the next
replica from the tokens received (``tokenwire.resume``), within the same policy, unless
``generate(..., resume=False)``. Those decisions are ``tokenwire.attempts``', and each
call is built from its arguments by ``tokenwire.calls``, both shared with
``tokenwire.aio``; this module does the blocking I/O around them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.attempts import Attempt, StreamAttempts, health_failure, health_status
from tokenwire.calls import (
    DEFAULT_TARGET,
    ClientBase,
    GenerateCall,
    Metadata,
    StreamBase,
    UnaryCall,
    same_arguments,
)
from tokenwire.errors import Unavailable
from tokenwire.formats import parse_answer
from tokenwire.results import Chunk, Completion, HealthStatus, ModelInfo, Score, Tokenization
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DEFAULT_TARGET", "ChunkStream", "Client", "Metadata"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class _StreamCall(Protocol):
    def __next__(self) -> pb.TokenChunk: ...
    def cancel(self) -> bool: ...


class ChunkStream(StreamBase[_StreamCall], Iterator[Chunk]):
    """The chunks of one Generate call, in order; the last carries finish_reason and usage.

    Use it in a ``for`` loop or ``with`` block; :meth:`cancel` (or leaving either
    early) cancels the RPC on the server.
    """

    def __init__(self, start: Callable[[Attempt], _StreamCall], attempts: StreamAttempts) -> None:
        super().__init__(start, attempts)
        self._lock = threading.Lock()  # cancel() may come from another thread

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            message = self._next_message()
        except BaseException as error:
            self._read_failed(error)
            raise
        chunk = self._received(message)
        if self._done:
            self._read_status()
        return chunk

    def _read_status(self) -> None:
        """Read the call to its end after the last chunk.

        The server sends its status right after the last chunk. A call object that is
        dropped before that status has arrived is cancelled by grpc, so without this
        read a complete answer would sometimes end as CANCELLED on the server (its
        logs and metrics). The answer is whole either way, so a failed status here
        is not raised.
        """
        with self._lock:
            call = self._call
        if call is None:
            return
        try:
            next(call)
        except (StopIteration, grpc.RpcError):
            return
        call.cancel()  # a message after the last chunk: nothing more is wanted

    def _next_message(self) -> pb.TokenChunk:
        while True:
            if self._call is None:
                attempt = self._next_attempt()
                with self._lock:
                    self._call = self._start(attempt)
            try:
                return next(self._call)
            except grpc.RpcError as rpc_error:
                delay = self._retry_delay(rpc_error)  # retry, resume or give up: tokenwire.attempts decides
            time.sleep(delay)

    def cancel(self) -> None:
        """Cancel the RPC on the server (no-op once it has ended)."""
        self._done = True
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    close = cancel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._done:
            self.cancel()

    def text(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        return Completion.from_chunks(list(self), self.request_id)


class Client(ClientBase):
    """A blocking client of tokenwire.v1.TextGeneration.

    ``target``: ``host:port``, any gRPC target (``dns:///tokenwire.default.svc:50051``)
    or a list of ``host:port`` addresses (calls are spread with round_robin).
    ``tls``: False (plaintext), True (system trust store) or a :class:`TLSConfig`.
    ``token``: sent as ``authorization: Bearer <token>`` on every call but health.
    ``timeout``: default deadline in seconds for each call, retries included.
    ``limits``: a server's limits to check requests against before sending them
    (``client.model_info().limits``). By default only the rules that hold on every
    server are checked here; the server enforces its own limits either way.
    """

    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        self._channel = (
            grpc.insecure_channel(self.target, options)
            if creds is None
            else grpc.secure_channel(self.target, creds, options)
        )
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._adapters = pb_grpc.AdaptersStub(self._channel)

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected; raise Unavailable if it is not in time."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"could not connect to {self.target} within {timeout} s") from None

    # -- Generate -----------------------------------------------------------------

    @same_arguments(ClientBase._generate_call)
    def generate(self, *args: Any, **kwargs: Any) -> ChunkStream:
        """Stream the completion of a prompt, a chat (``messages``) or token ids.

        The request is checked here, before anything is sent; the call starts on the
        first ``next()``. ``resume``: a stream cut by its replica goes on on another one
        from the tokens received, with no duplicate, gap or exception (docs/client.md).
        """
        return ChunkStream(*self._generate_call(*args, **kwargs).on(self._stub.Generate))

    @same_arguments(ClientBase._generate_call)
    def generate_text(self, *args: Any, **kwargs: Any) -> Completion:
        """The whole completion at once."""
        return self._completion(self._generate_call(*args, **kwargs))

    @same_arguments(ClientBase._chat_call)
    def chat(self, *args: Any, **kwargs: Any) -> Completion:
        """The model's whole reply to a conversation (stream it with ``generate(messages=...)``)."""
        return self._completion(self._chat_call(*args, **kwargs))

    @same_arguments(ClientBase._json_call)
    def generate_json(self, *args: Any, **kwargs: Any) -> Any:
        """An answer in a JSON schema (a dict or a pydantic model class; None: any JSON object),
        parsed: a pydantic instance for a model class, else the JSON value. Raises
        ``tokenwire.formats.IncompleteAnswer`` when max_new_tokens cut the answer short."""
        call, schema = self._json_call(*args, **kwargs)
        return parse_answer(self._completion(call), schema)

    def _completion(self, call: GenerateCall) -> Completion:
        with ChunkStream(*call.on(self._stub.Generate)) as stream:
            return stream.text()

    def score(self, prompt: str, continuations: Sequence[str], *, timeout: float | None = None) -> list[Score]:
        """How likely each continuation is after ``prompt`` (lm-eval's loglikelihood): its tokens'
        log-probabilities, their sum and whether it is the model's greedy answer, one scoring call
        (``max_new_tokens`` 0, ``prompt_logprobs``) per continuation. ``timeout``: per call."""
        out = []
        for continuation in continuations:
            context, whole = self._score_texts(prompt, continuation)
            context_ids = self.tokenize(context, timeout=timeout).ids
            whole_ids = self.tokenize(whole, timeout=timeout).ids
            completion = self._completion(self._score_call(whole_ids, timeout))
            out.append(Score.from_completion(completion, len(context_ids), continuation))
        return out

    # -- unary calls --------------------------------------------------------------

    def _unary(self, rpc: Callable[..., _R], call: UnaryCall[_R, _T]) -> _T:
        """Send ``call`` on ``rpc`` (a stub's), again after each failure tokenwire.attempts retries."""
        while True:
            try:
                return call.result(rpc(call.request, timeout=call.attempts.start(), metadata=call.metadata))
            except grpc.RpcError as rpc_error:
                delay = call.retry_delay(rpc_error)
            time.sleep(delay)

    @same_arguments(ClientBase._tokenize_call)
    def tokenize(self, *args: Any, **kwargs: Any) -> Tokenization:
        """The token ids of a text, or of a chat rendered with the model's template."""
        return self._unary(self._stub.Tokenize, self._tokenize_call(*args, **kwargs))

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model being served and the server's limits."""
        return self._unary(self._stub.GetModelInfo, self._model_info_call(timeout))

    def adapters(self, *, timeout: float | None = None) -> dict[str, int]:
        """The LoRA adapters the server has loaded, each with its rank (the Adapters service:
        its ``manage_adapters`` tenants; ``model_info().adapters`` is open to every caller)."""
        return self._unary(self._adapters.ListAdapters, self._list_adapters_call(timeout))

    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> int:
        """Load the PEFT LoRA folder ``path`` (relative to the server's --lora-dir) as ``name``;
        its rank. Calls may name it in ``generate(..., adapter=name)`` once this returns."""
        return self._unary(self._adapters.LoadAdapter, self._load_adapter_call(name, path, timeout))

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> int:
        """Unload ``name``: new calls naming it fail NotFound, the streams using it finish; how many run."""
        return self._unary(self._adapters.UnloadAdapter, self._unload_adapter_call(name, timeout))

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> HealthStatus:
        """The grpc.health.v1 status of ``service`` ("" is the whole server).

        An unknown service reads as SERVICE_UNKNOWN; an unreachable server raises
        Unavailable. Not retried and sent without the token, like a probe's check.
        """
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as rpc_error:
            return health_failure(rpc_error)
        return health_status(response)
