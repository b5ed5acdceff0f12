"""A scripted TextGeneration server for the client's tests: a real grpc server on
127.0.0.1, no model.

Generate echoes its input back word by word (one chunk, one "token" per word).
What it does besides is scripted through :class:`Script` (refuse the next N calls,
fail after a number of chunks, go slow, require a token) or through magic prompts:

- ``error:CODE``        fail before the first chunk with that status code
- ``slow:SECONDS text``  sleep that long between chunks
- ``fail-after:N text`` fail with UNAVAILABLE after N chunks (not on a resumed call:
  ``GenerateRequest.resume`` goes on from the ids and index it names)

It checks requests with ``tokenwire.validation`` (with a max_new_tokens cap of
``Script.max_new_tokens_limit``, which the client does not know), as the real server does.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire.validation import Limits, validate_generate_request

SERVICE_NAME = "tokenwire.v1.TextGeneration"
VOCAB_SIZE = 1000


class FakeRpcError(grpc.RpcError):
    """What grpc raises: an RpcError that is also a Call."""

    def __init__(self, code, details="", trailing=()):
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


@dataclasses.dataclass
class Script:
    refuse_next: int = 0  # refuse this many Generate calls before the first chunk
    refuse_always: bool = False
    refuse_code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_ms: int | None = 10  # RetryInfo on a refusal (None: none)
    pushback_trailer_ms: int | None = None  # grpc-retry-pushback-ms trailer instead
    fail_after_chunks: int | None = None  # UNAVAILABLE after this many chunks
    chunk_delay: float = 0.0
    required_token: str | None = None
    has_chat_template: bool = True
    max_new_tokens_limit: int = 100
    default_max_new_tokens: int = 64


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text) or [text]


class FakeTextGeneration(pb_grpc.TextGenerationServicer):
    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.script = Script()
        self.lock = threading.Condition()
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.generate_calls = 0
        self.served = 0  # calls that sent at least one chunk
        self.refused = 0
        self.cancelled = 0
        self.completed = 0
        self.unary_calls = 0

    # -- helpers ------------------------------------------------------------------

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:
        with self.lock:
            return self.lock.wait_for(lambda: predicate(self), timeout)

    def _abort(
        self,
        context: grpc.ServicerContext,
        code: grpc.StatusCode,
        message: str,
        details: list[any_pb2.Any] | None = None,
        trailer_ms: int | None = None,
    ) -> None:
        status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
        for detail in details or ():
            status.details.append(detail)
        grpc_status = rpc_status.to_status(status)
        if trailer_ms is not None:
            grpc_status = grpc_status._replace(
                trailing_metadata=(*grpc_status.trailing_metadata, ("grpc-retry-pushback-ms", str(trailer_ms)))
            )
        context.abort_with_status(grpc_status)

    def _check_auth(self, context: grpc.ServicerContext) -> None:
        token = self.script.required_token
        if token is None:
            return
        md = dict(context.invocation_metadata())
        if md.get("authorization") != f"Bearer {token}":
            self._abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    # -- TextGeneration -----------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        done = threading.Event()
        # Whether the RPC ended any other way than by the client going away.
        ended = {"by_server": False}

        def on_done() -> None:
            done.set()
            with self.lock:
                if not ended["by_server"]:
                    self.cancelled += 1
                self.lock.notify_all()

        context.add_callback(on_done)

        def fail(code: grpc.StatusCode, message: str, details=None, trailer_ms=None) -> None:
            ended["by_server"] = True
            self._abort(context, code, message, details, trailer_ms)

        with self.lock:
            self.generate_calls += 1
            self.requests.append(request)
            self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
            script = self.script
            refuse = script.refuse_always or script.refuse_next > 0
            if refuse and not script.refuse_always:
                script.refuse_next -= 1
            if refuse:
                self.refused += 1
            self.lock.notify_all()
        if self.script.required_token is not None:
            ended["by_server"] = True  # (an auth failure ends it; a pass resets below)
            self._check_auth(context)
            ended["by_server"] = False
        if refuse:
            details = []
            if script.retry_after_ms is not None:
                info = error_details_pb2.RetryInfo(
                    retry_delay=duration_pb2.Duration(
                        seconds=script.retry_after_ms // 1000, nanos=(script.retry_after_ms % 1000) * 1_000_000
                    )
                )
                any_info = any_pb2.Any()
                any_info.Pack(info)
                details.append(any_info)
            fail(script.refuse_code, f"{self.name} is full", details, trailer_ms=script.pushback_trailer_ms)

        violations = validate_generate_request(
            request, Limits(max_new_tokens_limit=script.max_new_tokens_limit, vocab_size=VOCAB_SIZE)
        )
        if violations:
            bad = error_details_pb2.BadRequest()
            for v in violations:
                bad.field_violations.add(field=v.field, description=v.description)
            any_bad = any_pb2.Any()
            any_bad.Pack(bad)
            fail(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(map(str, violations)), [any_bad])

        kind = request.WhichOneof("input")
        if kind == "chat":
            if not script.has_chat_template:
                fail(grpc.StatusCode.FAILED_PRECONDITION, "this model has no chat template")
            text = next((m.content for m in reversed(request.chat.messages) if m.role == "user"), "")
        elif kind == "token_ids":
            text = " ".join(f"t{i}" for i in request.token_ids.ids)
        else:
            text = request.prompt

        delay = script.chunk_delay
        fail_after = script.fail_after_chunks
        match = re.match(r"(error|slow|fail-after):(\S+)\s*(.*)", text, re.S)
        if match:
            verb, arg, rest = match.groups()
            if verb == "error":
                fail(getattr(grpc.StatusCode, arg), f"scripted {arg}")
            elif verb == "slow":
                delay, text = float(arg), rest
            else:
                fail_after, text = int(arg), rest

        words = _words(text)
        max_new = (
            request.stopping.max_new_tokens
            if request.stopping.HasField("max_new_tokens")
            else script.default_max_new_tokens
        )
        if request.stopping.ignore_eos:
            words = [words[i % len(words)] for i in range(max_new)]
        finish = pb.FINISH_REASON_LENGTH if request.stopping.ignore_eos else pb.FINISH_REASON_EOS
        if len(words) > max_new:
            words, finish = words[:max_new], pb.FINISH_REASON_LENGTH
        request_id = request.request_id or "srv-generated"
        want_tokens = request.output.token_ids or request.output.logprobs or request.output.top_logprobs > 0
        sent_text = ""
        index = 0
        if request.HasField("resume"):  # a cut stream goes on: a fresh replica, no scripted failure
            skip = len(request.resume.generated_token_ids)
            sent_text, words, index = "".join(words[:skip]), words[skip:], request.resume.next_index
            fail_after = None
        started = time.monotonic()
        matched: dict[str, object] = {}
        for word in words:
            if fail_after is not None and index == fail_after:
                fail(grpc.StatusCode.UNAVAILABLE, "scripted failure mid-stream")
            if (delay and done.wait(delay)) or done.is_set():
                return  # the client went away: on_done counted it
            chunk = pb.TokenChunk(request_id=request_id, index=index, text=word)
            if want_tokens:
                token = chunk.tokens.add(id=index % VOCAB_SIZE, text=word)
                if request.output.logprobs or request.output.top_logprobs:
                    token.logprob = -0.5
            stop_hit = next((s for s in request.stopping.stop_sequences if s in sent_text + word), None)
            if index % VOCAB_SIZE in request.stopping.stop_token_ids:  # its text left out, as the server does
                chunk.text = word if request.stopping.include_stop_sequence else ""
                finish, matched = pb.FINISH_REASON_STOP_TOKEN, {"stop_token_id": index % VOCAB_SIZE}
                stop_hit = ""
            elif stop_hit is not None:
                matched = {"stop_sequence": stop_hit}
                cut = (sent_text + word).index(stop_hit)
                keep = len(stop_hit) if request.stopping.include_stop_sequence else 0
                chunk.text = (sent_text + word)[len(sent_text) : cut + keep]
                finish = pb.FINISH_REASON_STOP_SEQUENCE
            sent_text += word
            yield chunk
            if index == 0:
                with self.lock:
                    self.served += 1
                    self.lock.notify_all()
            index += 1
            if stop_hit is not None:
                break
        total_ms = (time.monotonic() - started) * 1000
        ended["by_server"] = True
        yield pb.TokenChunk(
            request_id=request_id,
            index=index,
            text="",
            finish_reason=finish,
            **matched,  # type: ignore[arg-type]
            usage=pb.Usage(
                prompt_tokens=len(_words(text)),
                completion_tokens=index,
                queue_time_ms=0.1,
                time_to_first_token_ms=1.0,
                total_time_ms=total_ms,
            ),
        )
        with self.lock:
            self.completed += 1
            self.lock.notify_all()

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        with self.lock:
            self.unary_calls += 1
        self._check_auth(context)
        if request.WhichOneof("input") == "chat":
            text = "".join(f"<{m.role}>{m.content}" for m in request.chat.messages) + "<assistant>"
        else:
            text = request.text
        if text.startswith("error:"):
            self._abort(context, getattr(grpc.StatusCode, text[6:]), "scripted")
        words = _words(text)
        response = pb.TokenizeResponse(count=len(words), ids=[hash(w) % VOCAB_SIZE for w in words], text=text)
        if request.return_tokens:
            response.tokens.extend(words)
        if request.return_offsets:
            pos = 0
            for w in words:
                response.offsets.add(start=pos, end=pos + len(w))
                pos += len(w)
        return response

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        with self.lock:
            self.unary_calls += 1
        self._check_auth(context)
        return pb.ModelInfo(
            name=f"echo-{self.name}",
            context_length=2048,
            max_new_tokens_limit=self.script.max_new_tokens_limit,
            default_max_new_tokens=self.script.default_max_new_tokens,
            eos_token_ids=[0],
            has_chat_template=self.script.has_chat_template,
            dtype="float32",
            device="cpu",
            engine="fake",
            vocab_size=VOCAB_SIZE,
            max_active_streams=4,
            max_queued_requests=8,
        )


class FakeServer:
    """A FakeTextGeneration plus grpc health on 127.0.0.1:<free port>; a context manager."""

    def __init__(self, name: str = "fake") -> None:
        self.servicer = FakeTextGeneration(name)
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        pb_grpc.add_TextGenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.set_serving(True)

    @property
    def script(self) -> Script:
        return self.servicer.script

    def set_serving(self, serving: bool, service: str = SERVICE_NAME) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(service, status)

    def start(self) -> FakeServer:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
