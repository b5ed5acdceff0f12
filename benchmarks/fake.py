"""The servers ``--dry-run`` runs a suite against, in process on 127.0.0.1: a gRPC TextGeneration servicer and an
OpenAI-style SSE backend, each answering at once with a deterministic stream (token ``k`` depends on the request and
``k`` only, so a resumed stream goes on exactly). Their figures mean nothing."""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire_server.health import READINESS_SERVICE

TOKEN_S = 0.0005  # between tokens: enough for every gap to be measurable


def _answer(request: pb.GenerateRequest) -> tuple[int, str]:
    """(prompt tokens, the start of the answer a format asks for)."""
    prompt = request.prompt or " ".join(m.content for m in request.chat.messages) or str(list(request.token_ids.ids))
    if request.response_format.HasField("choice"):
        return len(prompt.split()), request.response_format.choice.options[0]
    return len(prompt.split()) or len(request.token_ids.ids), ""


class _Servicer(pb_grpc.TextGenerationServicer):
    def Generate(self, request: pb.GenerateRequest, context: Any) -> Any:
        prompt_tokens, fixed = _answer(request)
        if request.stopping.HasField("max_new_tokens") and request.stopping.max_new_tokens == 0:  # a scoring call
            chunk = pb.TokenChunk(request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH)
            chunk.prompt_tokens.extend(pb.Token(id=t, logprob=-1.0) for t in request.token_ids.ids)
            chunk.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens))
            yield chunk
            return
        new = 1 if fixed else min(request.stopping.max_new_tokens or 16, 512)  # a choice: one token, then EOS
        start = len(request.resume.generated_token_ids)
        key = pb.GenerateRequest()
        key.CopyFrom(request)
        key.ClearField("resume")
        key.ClearField("request_id")
        seed = zlib.crc32(key.SerializeToString(deterministic=True))
        for k in range(start, new):
            time.sleep(TOKEN_S)
            index, text = request.resume.next_index + k - start, fixed if k == 0 else " t"
            chunk = pb.TokenChunk(request_id=request.request_id, index=index, text=text)
            chunk.tokens.add(id=(seed + k) % 49152)
            if k == new - 1:
                chunk.finish_reason = pb.FINISH_REASON_EOS if fixed else pb.FINISH_REASON_LENGTH
                chunk.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=new,
                                              cached_prompt_tokens=prompt_tokens // 2))  # fmt: skip
            yield chunk

    def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        words = (request.text or " ".join(m.content for m in request.chat.messages)).split()
        return pb.TokenizeResponse(count=len(words), ids=[zlib.crc32(w.encode()) % 49152 for w in words])

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        return pb.ModelInfo(name="fake", engine="fake", device="cpu", max_active_streams=4, max_queued_requests=4)


class FakeServer:
    """Stands in for ``launcher.ServerProcess``: ``target``, ``proc`` (this process), ``find``; no metrics."""

    metrics_port = 0
    records: list[dict[str, Any]] = []

    def __init__(self, args: list[str]) -> None:
        self.args = list(args)
        self.server = grpc.server(futures.ThreadPoolExecutor(32))
        pb_grpc.add_TextGenerationServicer_to_server(_Servicer(), self.server)
        status = health.HealthServicer()
        status.set(READINESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"
        self.proc = SimpleNamespace(pid=os.getpid(), poll=lambda: None)
        self.server.start()

    def find(self, msg: str) -> list[dict[str, Any]]:
        """The log records a suite reads back: the torch settings it was started with."""
        if msg != "torch":
            return []
        spin = self.args[self.args.index("--omp-spin-count") + 1] if "--omp-spin-count" in self.args else "10000"
        return [{"msg": "torch", "omp_spin_count": "openmp-default" if spin == "0" else spin}]

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(None)


class _SSE(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"delta": {"content": "t"}}]} for _ in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": body["max_tokens"]}})
        for event in events:
            time.sleep(TOKEN_S)
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


class FakeOpenAI:
    """Stands in for ``launcher.OpenAIServer``: ``port``, ``proc.pid``, ``command``, ``close``."""

    def __init__(self) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
        self.port = self.http.server_address[1]
        self.proc = SimpleNamespace(pid=os.getpid())
        self.command = ["python", "-m", "fake-openai", "--port", str(self.port)]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
