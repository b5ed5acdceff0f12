"""``LocalBackend``: the batched or simple engine, on a model loaded in this process,
behind the backend seam.

It owns the prompt encoder (its own thread pool, so chat templates and long
prompts never block the event loop) and the engine, and describes both in plain
types for the transport.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from ..backend import ThreadedSubmission
from ..domain import (
    Encoding,
    EngineStats,
    GenerationRequest,
    ModelDescription,
    Prompt,
    RequestLimits,
    ResponseFormat,
)
from ..model import LoadedModel
from ..text import PromptEncoder
from .base import Engine


class LocalBackend:
    def __init__(self, loaded: LoadedModel, engine: Engine, limits: RequestLimits, encode_threads: int = 2) -> None:
        self.loaded = loaded
        self.engine = engine
        self.encoder = PromptEncoder(engine.tokenizer)
        self._limits = limits
        self._encode_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=encode_threads, thread_name_prefix="tokenwire-encode"
        )
        # Response formats compile on their own threads: a page-long schema can take seconds,
        # and must not hold up the prompts of other calls.
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenwire-grammar")

    def describe(self) -> ModelDescription:
        loaded, engine = self.loaded, self.engine
        return ModelDescription(
            name=loaded.name,
            engine=engine.name,
            dtype=loaded.dtype_name,
            device=str(loaded.device),
            vocab_size=loaded.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            bos_token_id=loaded.bos_token_id,
            has_chat_template=self.encoder.has_chat_template,
            default_sampling=loaded.default_sampling,
            limits=self._limits,
            max_active=engine.limits.max_active,
            max_queue=engine.limits.max_queue,
            quantization=loaded.quantization,
        )

    async def encode(self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False) -> Encoding:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._encode_pool, lambda: self.encoder.encode(prompt, offsets=offsets, tokens=tokens)
        )

    async def check_format(self, fmt: ResponseFormat) -> float | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compile_pool, lambda: self.engine.grammars.compile(fmt)[1])

    def submit(self, request: GenerationRequest) -> ThreadedSubmission:
        submission = ThreadedSubmission(asyncio.get_running_loop())
        submission.handle = self.engine.submit(request, submission.sink)
        return submission

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def stalled(self, timeout_s: float) -> bool:
        return self.engine.stalled(timeout_s)

    def failure(self) -> str | None:
        return self.engine.failure()

    def stop_admission(self) -> None:
        self.engine.queue.close()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        self._encode_pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
