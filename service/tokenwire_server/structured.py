"""Constrained decoding: answers that follow a JSON schema, a regex, a choice or a grammar.

The library is xgrammar, the one vLLM, SGLang and TensorRT-LLM use: it compiles a
format into a grammar over the tokenizer's vocabulary once, and then gives, at each
step, the set of tokens that can continue a valid answer as a bitmask (a few
microseconds a row). Using the same library as vLLM means one set of formats and one
set of error messages on both engines (``--engine vllm`` passes the same format to
vLLM's xgrammar backend).

- ``Grammars`` (one per served model) compiles a ``ResponseFormat`` and caches the
  result by content, bounded by its compiled size (``CACHE_BYTES``). The tokenizer's
  vocabulary is read on first use, so a server that never sees a constrained request
  pays nothing. A format the library refuses raises ``InvalidResponseFormat`` with the
  library's message and the request field.
- ``Constraint`` is one request's matcher: it writes the allowed tokens into its row
  of a step's bitmask and advances with each token the request takes.
- ``apply_constraints`` masks the constrained rows of a step's logits (xgrammar's own
  kernel on a CPU; on a device, ``apply_bitmask``'s plain torch ops, since xgrammar's
  CUDA kernel is built by Triton at run time, with a C compiler); the other rows are
  not touched.

JSON is generated compact (no whitespace between tokens: separators ``,`` and ``:``),
and a schema's objects hold the properties it names and no others (xgrammar's strict
mode): fewer tokens, and nothing a parser would not expect.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from .domain import InvalidResponseFormat, ResponseFormat

# Compiled grammars kept for reuse, by their compiled size (a page-long schema is ~100 KB).
CACHE_BYTES = 64 << 20
JSON_SEPARATORS = (",", ":")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_EBNF_RULE = re.compile(r"::=")


def library_message(exc: BaseException) -> str:
    """The library's own message, without its source location."""
    text = str(exc).strip() or type(exc).__name__
    return _CPP_PREFIX.sub("", text).strip()


def is_lark(grammar: str) -> bool:
    """A grammar is EBNF when a line (outside comments) defines a rule with ``::=``, else Lark
    (the rule vLLM applies, so a grammar means the same on both engines)."""
    for line in grammar.splitlines():
        line = re.sub(r"(#|//).*$", "", line).strip()
        if line and _EBNF_RULE.search(line):
            return False
    return True


DEAD_END = (
    "no token of this model's vocabulary can begin an answer in this format (does it need a character no token holds?)"
)
STUCK = (
    "the answer reached a point that no token of this model's vocabulary can continue in this format "
    "(does it need a character no token holds?)"
)


def choice_grammar(options: Sequence[str]) -> str:
    """An EBNF grammar whose answers are exactly ``options``."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)


class Constraint:
    """One request's place in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = int(compiled.tokenizer_info.vocab_size)

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the tokens that may come next into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False when the grammar does not allow it (nothing changes)."""
        return bool(self._matcher.accept_token(token_id))

    def can_continue(self) -> bool:
        """Whether any token (end of sequence included) may come next from here."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return bool(mask.any())

    @property
    def terminated(self) -> bool:
        """The answer is complete (the grammar took its end-of-sequence token)."""
        return bool(self._matcher.is_terminated())


class Grammars:
    """Compiles response formats for one model's vocabulary, with a bounded cache by content."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._threads = threads
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[ResponseFormat, tuple[Any, int]] = collections.OrderedDict()
        self._cached_bytes = 0

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
            return self._compiler

    def prepare(self) -> None:
        """Build the compiler now (it reads the whole vocabulary, ~0.3 s), not in the first compile."""
        self._get_compiler()

    def compile(self, fmt: ResponseFormat) -> tuple[Any, float | None]:
        """The compiled grammar of ``fmt`` and the seconds compiling took (None: from the cache).

        Raises ``InvalidResponseFormat`` with the library's message when it cannot be compiled.
        """
        with self._lock:
            hit = self._cache.get(fmt)
            if hit is not None:
                self._cache.move_to_end(fmt)
                return hit[0], None
        compiler = self._get_compiler()
        started = time.perf_counter()
        try:
            compiled = self._compile(compiler, fmt)
        except Exception as exc:  # the library reports a bad format with RuntimeError/ValueError/TypeError
            raise InvalidResponseFormat(fmt.field, library_message(exc)) from None
        if not Constraint(compiled).can_continue():
            raise InvalidResponseFormat(fmt.field, DEAD_END)
        seconds = time.perf_counter() - started
        size = int(getattr(compiled, "memory_size_bytes", 0))
        with self._lock:
            if fmt not in self._cache:
                self._cache[fmt] = (compiled, size)
                self._cached_bytes += size
                while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._cached_bytes -= dropped
        return compiled, seconds

    def constraint(self, fmt: ResponseFormat) -> Constraint:
        return Constraint(self.compile(fmt)[0])

    @staticmethod
    def _compile(compiler: Any, fmt: ResponseFormat) -> Any:
        kind = fmt.kind
        if kind == "json_schema":
            return compiler.compile_json_schema(fmt.spec, any_whitespace=False, separators=JSON_SEPARATORS)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS)
        if kind == "regex":
            return compiler.compile_regex(fmt.spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(fmt.options))
        if kind == "grammar":
            return compiler.compile_lark(fmt.spec) if is_lark(fmt.spec) else compiler.compile_grammar(fmt.spec)
        raise InvalidResponseFormat("response_format", f"unknown format {kind!r}")


def apply_constraints(
    logits: Any, rows: Sequence[tuple[int, Constraint]], vocab_size: int
) -> list[tuple[int, BaseException]]:
    """Set to -inf, in place, every token a constrained row's grammar does not allow next;
    return the rows whose grammar failed to say (a library error), each with its error: those
    rows are left unmasked, for the caller to fail alone, not the step's other rows.

    The bitmask is made for each call (a few KB a row): the simple engine's workers share
    one sampler, and a shared buffer would mix their rows. On a CPU xgrammar applies it;
    on a device (``apply_bitmask``) torch ops do, where xgrammar's CUDA path is a Triton
    kernel built at run time with a C compiler the serving image does not have.
    """
    import torch
    import xgrammar as xgr

    from .transfer import host_tensor, to_device

    on_cpu = logits.device.type == "cpu"
    mask = xgr.allocate_token_bitmask(int(logits.shape[0]) if on_cpu else len(rows), vocab_size)
    failed: list[tuple[int, BaseException]] = []
    masked: list[int] = []
    for k, (row, constraint) in enumerate(rows):
        at = row if on_cpu else k
        try:
            constraint.fill(mask, at)
        except Exception as exc:  # the library's error: this row's, not the step's
            failed.append((row, exc))
            mask[at] = -1  # every token allowed: the row is failed before its pick is used
        else:
            masked.append(row)
    if not masked:
        return failed
    if on_cpu:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size, indices=masked)
    else:
        # Both pinned and queued: the host does not wait for the forward pass.
        index = host_tensor([row for row, _ in rows], torch.long, logits.device)
        apply_bitmask(logits, to_device(mask, logits.device), index, vocab_size)
    return failed


def apply_bitmask(logits: Any, mask: Any, index: Any, vocab_size: int) -> None:
    """``logits[index[k], t] = -inf`` wherever bit ``t`` of row ``k`` of ``mask`` (xgrammar's
    packed int32 bitmask, bit ``t % 32`` of word ``t // 32``) is 0, for ``t < vocab_size``.
    Plain tensor ops on the logits' device: no kernel is compiled, nothing is read back."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    rows = logits.index_select(0, index)
    rows[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, rows)
