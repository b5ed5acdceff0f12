"""``LocalBackend``: the batched or simple engine, on a model loaded in this process,
behind the backend seam.

It owns the prompt encoder (its own thread pool, so chat templates and long
prompts never block the event loop) and the engine, and describes both in plain
types for the transport.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

from ..backend import ThreadedSubmission
from ..domain import (
    AdapterDescription,
    EngineStats,
    GenerationRequest,
    ModelDescription,
    RequestLimits,
)
from ..intake import Intake, IntakeBackend
from ..model import LoadedModel
from ..text import PromptEncoder
from .base import Engine


class LocalBackend(IntakeBackend):
    def __init__(self, loaded: LoadedModel, engine: Engine, limits: RequestLimits, encode_threads: int = 2) -> None:
        self.loaded = loaded
        self.engine = engine
        self._adapter_lock = threading.Lock()
        self.encoder = PromptEncoder(engine.tokenizer)
        # What a prompt that fits may be long, in characters, on this tokenizer (published).
        self._limits = dataclasses.replace(limits, max_prompt_chars=self.encoder.max_chars(limits.max_request_tokens))
        self.intake = Intake(
            self.encoder,
            lambda fmt: engine.grammars.compile(fmt)[1],
            timeout_s=limits.format_compile_timeout_s,
            prepare=engine.grammars.prepare,
            encode_threads=encode_threads,
        )

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
            adapters=tuple(AdapterDescription(a.name, a.rank, tuple(a.modules)) for a in engine.adapters()),
            applies_adapters=engine.applies_adapters,
        )

    def load_adapter(self, name: str, folder: Path) -> AdapterDescription:
        """Read ``folder``, check it against the model and the limits, and apply it to the requests
        naming ``name`` (at start, ``--lora``, and while serving, LoadAdapter)."""
        from ..adapters import admit

        engine, limits = self.engine, self._limits
        with self._adapter_lock:  # one load at a time: the limit and the name hold across loads
            loaded = [adapter.name for adapter in engine.adapters()]
            adapter = admit(name, folder, loaded, limits.max_loras, self.loaded.model.config, limits.max_lora_rank)
            engine.add_adapter(adapter)
        return AdapterDescription(adapter.name, adapter.rank, tuple(adapter.modules))

    def unload_adapter(self, name: str) -> int:
        with self._adapter_lock:
            return self.engine.remove_adapter(name)

    def submit(self, request: GenerationRequest) -> ThreadedSubmission:
        submission = ThreadedSubmission(asyncio.get_running_loop())
        submission.handle = self.engine.submit(request, submission.sink, submission)  # it is the stream's reader too
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
        self.intake.close()
