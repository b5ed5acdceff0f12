"""Resuming a cut stream: what the client keeps of a stream so that another replica can
continue it, and when it does.

A tokenwire server can continue a stream from any token (``GenerateRequest.resume``): it
reads the prompt and the tokens the caller already has, and goes on as the uncut stream
would have, from the next chunk index, with the same seed. So the client asks for token
ids under the hood, keeps them with the next index and the seed the first chunk names,
and when a started stream fails with UNAVAILABLE (a replica that died, was cut off or
handed its streams off while draining) or a CANCELLED it did not ask for, it reissues the
call with ``resume``, to the next replica (round robin), with the same retry budget and
backoff as a refused call. The caller's iterator goes on from the next chunk: nothing
repeated, nothing lost, no exception. ``Usage.resumes`` says how many times it happened.
"""

from __future__ import annotations

import dataclasses

import grpc

from tokenwire.errors import TokenwireError
from tokenwire.results import Chunk
from tokenwire.v1 import generation_pb2 as pb

__all__ = ["Resumption"]

# Statuses after which a started stream is resumed: the replica went away or handed it off
# (UNAVAILABLE), or dropped the call (a CANCELLED this side did not ask for).
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class Resumption:
    """One stream's state for a resume: token ids received, the next index, the seed."""

    def __init__(self, request: pb.GenerateRequest, enabled: bool) -> None:
        self.enabled = enabled
        output = request.output
        self._caller_wants_tokens = (
            output.token_ids or output.logprobs or output.top_logprobs > 0 or bool(output.logprobs_of)
        )
        if enabled and not self._caller_wants_tokens:
            request = _copy(request)
            request.output.token_ids = True  # a resume sends them back: the client keeps them
        self.request = request  # what the first call sends
        self.ids: list[int] = list(request.resume.generated_token_ids)
        self.next_index = request.resume.next_index
        self.seed: int | None = None
        self.resumes = 0

    def received(self, message: pb.TokenChunk) -> Chunk:
        """Take one chunk off the wire; return it as the caller sees it."""
        if message.HasField("seed") and self.seed is None:
            self.seed = message.seed
        self.ids.extend(token.id for token in message.tokens)
        self.next_index = message.index + 1
        chunk = Chunk.from_proto(message)
        if self.enabled and not self._caller_wants_tokens:
            chunk = dataclasses.replace(chunk, tokens=())
        if chunk.usage is not None and self.resumes:
            chunk = dataclasses.replace(chunk, usage=dataclasses.replace(chunk.usage, resumes=self.resumes))
        return chunk

    def resumable(self, error: TokenwireError, *, cancelled_here: bool) -> bool:
        """Whether a started stream that failed with ``error`` may go on elsewhere."""
        if not self.enabled or cancelled_here:
            return False
        return error.code in RESUMABLE

    def resumed_request(self) -> pb.GenerateRequest:
        """The request that continues the stream from what has been received."""
        self.resumes += 1
        request = _copy(self.request)
        request.resume.generated_token_ids[:] = self.ids
        request.resume.next_index = self.next_index
        request.resume.SetInParent()
        if self.seed is not None and not request.sampling.HasField("seed"):
            request.sampling.seed = self.seed  # the seed the server chose: the same tokens follow
        return request


def _copy(request: pb.GenerateRequest) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    return out
