"""A call's input work before admission, bounded: encoding prompts and compiling response
formats, off the event loop, so that no caller's input can starve the others'.

``Intake`` is what both backends' ``encode()`` and ``check_format()`` run on (the batched and
simple engines' ``LocalBackend`` and the vllm engine's):

- **Encoding in two lanes.** A prompt of up to ``BULK_CHARS`` characters is encoded on the
  shared pool; a longer one (or a long Tokenize text) goes to a one-thread bulk lane, so a
  few megabyte-long texts wait for each other and never for the short prompts behind them.
  After a bulk encode the C allocator is asked to give its free memory back to the system
  (``malloc_trim``): the tokenizer's buffers for a giant text would otherwise stay in the
  process's resident memory after it is refused.
- **A Generate's prompt is bounded before it is read** (``PromptEncoder.encode``'s
  ``max_tokens``): a text longer than any that could fit is refused without tokenizing, a
  shorter one is tokenized with truncation one past the limit.
- **Compiling with a time limit.** Each compile has ``timeout_s``; past it the call is
  refused "too complex" (``InvalidResponseFormat``), and the same format sent again is
  refused at once. The compile itself cannot be stopped (the library's C++ runs to its end),
  so it goes on in the background holding its tenant's one compile slot: a tenant compiles
  one format at a time, and the two compile threads can never both be held by one tenant's
  runaway formats.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import ctypes.util
import hashlib
import logging
from collections.abc import Callable

from .domain import Encoding, InvalidResponseFormat, Prompt, ResponseFormat, TextPrompt
from .text import PromptEncoder

log = logging.getLogger(__name__)

# Prompts longer than this (characters) are encoded on the bulk lane.
BULK_CHARS = 32 * 1024
COMPILE_THREADS = 2
# Formats that took too long to compile, remembered (by digest) to refuse a resend at once.
TOO_COMPLEX_REMEMBERED = 1024
TOO_COMPLEX = (
    "is too complex: compiling it took longer than this server allows ({limit_ms} ms, "
    "RequestLimits.max_format_compile_ms); simplify it (fewer nested or alternative parts)"
)


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``: return the heap's free pages to the system; a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return lambda: None
    return lambda: trim(0) and None


def prompt_chars(prompt: Prompt) -> int:
    """Characters of text a prompt brings (0 for token ids): which lane encodes it."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    messages = getattr(prompt, "messages", ())
    return sum(len(role) + len(content) for role, content in messages)


class Intake:
    def __init__(
        self,
        encoder: PromptEncoder,
        compile_format: Callable[[ResponseFormat], float | None],
        *,
        timeout_s: float,
        prepare: Callable[[], object] = lambda: None,
        encode_threads: int = 2,
    ) -> None:
        self.encoder = encoder
        self._compile_format = compile_format
        self._prepare = prepare  # the compiler's one-time set-up (reads the vocabulary): never timed
        self._prepared = False
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=encode_threads, thread_name_prefix="tokenwire-encode"
        )
        self._bulk = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenwire-encode-bulk")
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=COMPILE_THREADS, thread_name_prefix="tokenwire-grammar"
        )
        self._trim = _malloc_trim()
        self._compiling: dict[str, asyncio.Semaphore] = {}  # one compile in flight per tenant
        self._too_complex: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    async def encode(
        self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False, max_tokens: int | None = None
    ) -> Encoding:
        loop = asyncio.get_running_loop()
        if prompt_chars(prompt) <= BULK_CHARS:
            return await loop.run_in_executor(
                self._pool, lambda: self.encoder.encode(prompt, offsets=offsets, tokens=tokens, max_tokens=max_tokens)
            )

        def bulk() -> Encoding:
            try:
                return self.encoder.encode(prompt, offsets=offsets, tokens=tokens, max_tokens=max_tokens)
            finally:
                self._trim()

        return await loop.run_in_executor(self._bulk, bulk)

    async def check_format(self, fmt: ResponseFormat, tenant: str = "default", *, limited: bool = True) -> float | None:
        """Compile ``fmt`` (the seconds it took; None: cached) within the time limit (none unless
        ``limited``), or raise ``InvalidResponseFormat``: the library's own error, or "too complex"."""
        digest = hashlib.sha256(repr(fmt).encode("utf-8", "surrogatepass")).digest()
        if digest in self._too_complex:
            self._too_complex.move_to_end(digest)
            raise InvalidResponseFormat(fmt.field, self._too_complex_message())
        loop = asyncio.get_running_loop()
        if not self._prepared:
            await loop.run_in_executor(self._compile_pool, self._prepare)
            self._prepared = True
        slot = self._compiling.setdefault(tenant, asyncio.Semaphore(1))
        await slot.acquire()
        try:
            future = loop.run_in_executor(self._compile_pool, self._compile_format, fmt)
        except BaseException:
            slot.release()
            raise
        future.add_done_callback(lambda _: slot.release())  # held until the compile ends, on time or not
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s if limited else None)
        except TimeoutError:
            future.add_done_callback(lambda done: done.cancelled() or done.exception())  # its outcome is nobody's
            self._too_complex[digest] = None
            while len(self._too_complex) > TOO_COMPLEX_REMEMBERED:
                self._too_complex.popitem(last=False)
            log.warning(
                "response format too complex",
                extra={"kind": fmt.kind, "limit_ms": round(self.timeout_s * 1000), "tenant": tenant},
            )
            raise InvalidResponseFormat(fmt.field, self._too_complex_message()) from None

    def _too_complex_message(self) -> str:
        return TOO_COMPLEX.format(limit_ms=round(self.timeout_s * 1000))

    def close(self) -> None:
        for pool in (self._pool, self._bulk, self._compile_pool):
            pool.shutdown(wait=False, cancel_futures=True)


class IntakeBackend:
    """The seam's ``encode`` and ``check_format`` for a backend whose input work runs on its
    ``intake`` (both local backends)."""

    intake: Intake

    async def encode(
        self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False, max_tokens: int | None = None
    ) -> Encoding:
        return await self.intake.encode(prompt, offsets=offsets, tokens=tokens, max_tokens=max_tokens)

    async def check_format(self, fmt: ResponseFormat, tenant: str = "default", *, limited: bool = True) -> float | None:
        return await self.intake.check_format(fmt, tenant, limited=limited)
