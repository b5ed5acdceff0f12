"""Text: incremental detokenization and stop-sequence matching.

Byte-level BPE splits one character (an emoji, a CJK ideograph) across tokens, so
decoding one token at a time yields U+FFFD halves. ``Detokenizer`` streams with the
``tokenizers`` library's ``DecodeStream`` (Rust, O(1) per token: it keeps only the few
tokens since its last emission) and holds text back while it ends in a partial
character; a tokenizer without a Rust backend gets ``OffsetDetokenizer``, the same
prefix/read-offset scheme in Python (as Hugging Face TGI does, two decodes per token).
``StopMatcher`` holds back only the tail of the text that could still grow into a stop
sequence. ``TextStream`` chains the two; the concatenation of what it emits equals the
decoded completion (``skip_special_tokens=True``, ``clean_up_tokenization_spaces=False``),
cut at the stop.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Sequence
from typing import Any

from .domain import ChatPrompt, Encoding, NoChatTemplate, Prompt, TokenPrompt

REPLACEMENT = "\ufffd"


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


class OffsetDetokenizer:
    """Turns token ids, one at a time, into text that never splits a character: the fallback.

    Each push decodes twice, from a few tokens back (the prefix offset) to the last
    emission (the read offset) and to the new token, and emits the difference once it does
    not end in U+FFFD. Any tokenizer with ``decode`` will do; ``Detokenizer`` is the same in
    O(1) per token where the tokenizer has a Rust backend.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text ('' while a character is partial)."""
        self.ids.append(token_id)
        # Decoding from a few tokens back gives the context byte-level merges need.
        prefix_text = _decode(self._tokenizer, self.ids[self._prefix_offset : self._read_offset])
        new_text = _decode(self._tokenizer, self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self._emitted.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever the full decode has beyond what was emitted.

        A completion cut mid-character ends in U+FFFD, exactly as the full decode does.
        """
        return _rest(_decode(self._tokenizer, self.ids), self._emitted)


def _rest(full: str, emitted: list[str]) -> str:
    """What ``full`` has beyond the pieces ``emitted`` so far (appended to them)."""
    done = "".join(emitted)
    if full.startswith(done):
        rest = full[len(done) :]
    else:  # not seen with byte-level BPE; keep the stream consistent regardless
        rest = full[len(done) :] if len(full) > len(done) else ""
    if rest:
        emitted.append(rest)
    return rest


def backend_of(tokenizer: Any) -> Any:
    """``tokenizer``'s Rust ``tokenizers.Tokenizer``, to decode with from any thread (None: it has
    none); a ``SharedTokenizer``'s is its original's."""
    if isinstance(tokenizer, SharedTokenizer):
        return tokenizer.backend()
    return getattr(tokenizer, "backend_tokenizer", None)


class Detokenizer:
    """Turns token ids, one at a time, into text that never splits a character, in O(1) per token.

    ``tokenizers.decoders.DecodeStream`` runs the prefix/read-offset scheme in Rust on the
    tokens since its last emission only (it drops the ones before), and says None while the
    text ends in U+FFFD. A tokenizer without a Rust backend falls back to ``OffsetDetokenizer``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._emitted: list[str] = []
        # NOTE: one Rust tokenizer for every thread that pushes (the submitting thread replays a
        # resumed stream, the engine's reads it): decoding borrows it immutably, and a
        # SharedTokenizer's original is never encoded with. A tokenizer some thread encodes with
        # (truncation/padding state: a mutable borrow) would fail here with "Already borrowed".
        self._backend = backend_of(tokenizer)
        self._fallback = OffsetDetokenizer(tokenizer) if self._backend is None else None
        if self._fallback is not None:
            self.ids = self._fallback.ids
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text ('' while a character is partial)."""
        if self._fallback is not None:
            return self._fallback.push(token_id)
        self.ids.append(token_id)
        assert self._backend is not None
        delta = self._stream.step(self._backend, token_id)
        if delta:
            self._emitted.append(delta)
            return str(delta)
        return ""

    def flush(self) -> str:
        """At the end: whatever the full decode has beyond what was emitted (one decode of the
        whole completion, once per stream). A completion cut mid-character ends in U+FFFD,
        exactly as the full decode does."""
        if self._fallback is not None:
            return self._fallback.flush()
        return _rest(_decode(self._tokenizer, self.ids), self._emitted)


class StopMatcher:
    """Finds stop sequences in streamed text; holds back only what could still match."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop sequence matched)."""
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._pending + text
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0:
                key = (at + len(stop), at, stop)  # the stop that ends first wins
                if best is None or key < best:
                    best = key
        if best is not None:
            _, at, stop = best
            self.matched = stop
            self._pending = ""
            return buffer[: at + len(stop)] if self._include else buffer[:at], True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(buffer) - hold
        self._pending = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """At the end without a match: release what was held back."""
        pending, self._pending = self._pending, ""
        return pending


class TextStream:
    """Detokenizer then stop matcher: what a stream may show after each token."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), include_stop: bool = False) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = StopMatcher(stops, include_stop)

    def push(self, token_id: int) -> tuple[str, bool]:
        return self.stops.push(self.detokenizer.push(token_id))

    def finish(self) -> tuple[str, bool]:
        """The text still held at the end; True when it completed a stop sequence."""
        if self.stops.matched is not None:
            return "", True
        text, matched = self.stops.push(self.detokenizer.flush())
        if matched:
            return text, True
        return text + self.stops.flush(), False


def rust_encoder(tokenizer: Any) -> Any:
    """The Rust ``tokenizers.Tokenizer`` whose ``encode_batch`` is this tokenizer's own encoding
    of a text, or None. That holds for transformers' generic ``TokenizersBackend`` (what a
    tokenizer.json folder loads as, the default model's included) and its subclasses that keep
    its encoding: its ``__call__`` sets the Rust tokenizer's truncation, padding and
    special-token splitting to what the call asks, then calls ``encode_batch``. A call that asks
    for none of them changes nothing, so the Rust tokenizer's own call is the same encoding."""
    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4: its fast tokenizers encode another way
        return None
    kind = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or kind.__call__ is not TokenizersBackend.__call__
        or kind._encode_plus is not TokenizersBackend._encode_plus
        or hasattr(tokenizer, "_switch_to_input_mode")
    ):
        return None
    backend = tokenizer.backend_tokenizer
    return backend if backend.encode_special_tokens == bool(tokenizer.split_special_tokens) else None


class SharedTokenizer:
    """One tokenizer, safe to use from many threads.

    Decoding reads the original, from every thread at once, with no copy: decode and
    ``DecodeStream.step`` borrow the Rust tokenizer immutably.

    Encoding (``encode_text``) reads the original too where its Rust tokenizer's own
    ``encode_batch`` is the tokenizer's encoding (``rust_encoder``): that call also borrows it
    immutably, and the Rust tokenizer's truncation and padding are never set. Elsewhere (another
    tokenizer class, or truncation or padding set on the Rust tokenizer) encoding takes the
    calling thread's own copy: transformers' call sets the Rust tokenizer's truncation and
    padding state (a mutable borrow), and a second thread touching it meanwhile fails with
    "Already borrowed". A copy rebuilds the Rust tokenizer from its JSON (~0.1-0.25 s for a 49k
    vocabulary, with the GIL held), once per thread: with the default model there is none.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._original = tokenizer
        self._copies = threading.local()
        self._lock = threading.Lock()  # deepcopy reads the original: one copy at a time
        self._token_texts: dict[int, str] = {}  # token_text's cache, at most the vocabulary
        self._rust = rust_encoder(tokenizer)

    def get(self) -> Any:
        """This thread's own copy of the tokenizer, to encode with through transformers."""
        mine = getattr(self._copies, "tokenizer", None)
        if mine is None:
            with self._lock:
                mine = copy.deepcopy(self._original)
            self._copies.tokenizer = mine
        return mine

    def encode_text(
        self, text: str, *, add_special_tokens: bool, offsets: bool = False, limit: int | None = None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """``text``'s token ids, at most ``limit`` of them (a longer encoding is cut), and with
        ``offsets`` each one's character span; as the tokenizer's own call gives them."""
        rust = self._rust
        if rust is not None and rust.truncation is None and rust.padding is None:
            [encoding] = rust.encode_batch([text], add_special_tokens=add_special_tokens, is_pretokenized=False)
            ids, spans = encoding.ids, encoding.offsets if offsets else []
            return list(ids[:limit]), list(spans[:limit])
        tokenizer = self.get()
        cut = {"truncation": True, "max_length": limit} if limit is not None else {}
        encoded = tokenizer(
            text, add_special_tokens=add_special_tokens, return_offsets_mapping=offsets and tokenizer.is_fast, **cut
        )
        spans = [(int(a), int(b)) for a, b in encoded.get("offset_mapping", [])] if offsets else []
        return [int(i) for i in encoded["input_ids"]], spans

    def reader(self) -> Any:
        """A tokenizer to render chat templates and decode with on this thread: the original where
        encoding makes no copies (``encode_text``), else this thread's copy."""
        return self._original if self._rust is not None else self.get()

    @property
    def original(self) -> Any:
        """The tokenizer the copies are made from: read and decode with it, never encode."""
        return self._original

    def backend(self) -> Any:
        """The original's Rust ``tokenizers.Tokenizer``, to decode with from any thread (None: a
        tokenizer without one)."""
        return getattr(self._original, "backend_tokenizer", None)

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return str(self._original.decode(list(ids), **kwargs))

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens shown (``TokenInfo.text``), from a cache shared by
        the threads (a token's text never changes; a dict read or write is atomic)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        return text

    @property
    def chat_template(self) -> str | None:
        return getattr(self._original, "chat_template", None)


class PromptEncoder:
    """Turns a prompt, a chat or token ids into what the model reads, the same way for
    Generate and Tokenize. Thread-safe (``SharedTokenizer``); call it off the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer if isinstance(tokenizer, SharedTokenizer) else SharedTokenizer(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

    def render_chat(self, messages: Sequence[tuple[str, str]]) -> str:
        """The chat as the model sees it: its own template, with the assistant's turn opened."""
        if not self.has_chat_template:
            raise NoChatTemplate("this model has no chat template")
        return str(
            self._tokenizer.reader().apply_chat_template(
                [{"role": role, "content": content} for role, content in messages],
                add_generation_prompt=True,
                tokenize=False,
            )
        )

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Most characters of text one token can stand for; 0 when no bound is known.

        A token covers at most as many characters as its vocabulary entry is long (byte-level
        entries are one character per byte, SentencePiece ones one per character, byte
        fallbacks ``<0x0A>`` more). A normalizer can drop characters, and an added token that
        strips the spaces beside it covers more than its entry: with either, no bound."""
        tokenizer = self._tokenizer.original  # read alone, on the thread that builds the backend
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return 0
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        if any(getattr(token, "lstrip", False) or getattr(token, "rstrip", False) for token in added.values()):
            return 0
        return max((len(entry) for entry in tokenizer.get_vocab()), default=0)

    def max_chars(self, max_tokens: int) -> int:
        """Longest text that can encode to at most ``max_tokens`` tokens (0: no bound known)."""
        return max_tokens * self.longest_token_chars

    def encode(
        self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False, max_tokens: int | None = None
    ) -> Encoding:
        """Token ids of ``prompt``; with the rendered text, and offsets/token strings on request.

        With ``max_tokens`` (a Generate's prompt, which must fit the context), a text that
        cannot encode to that few tokens is not tokenized at all, and a longer one is cut at
        ``max_tokens + 1`` ids: either way the encoding says ``truncated``, and its ids tell
        only that the prompt is longer than ``max_tokens``."""
        if isinstance(prompt, TokenPrompt):
            ids = list(prompt.ids)
            return Encoding(ids, tokens=self.token_strings(ids) if tokens else [])
        templated = isinstance(prompt, ChatPrompt)
        text = self.render_chat(prompt.messages) if isinstance(prompt, ChatPrompt) else prompt.text
        if max_tokens is not None:
            # The bound is at least max_tokens characters (a vocabulary entry is at least one): a
            # shorter text is within it, and the bound, which reads the whole vocabulary once, waits.
            if len(text) > max_tokens and len(text) > (self.max_chars(max_tokens) or len(text)):
                return Encoding([], text, truncated=True, chars=len(text))
        # A rendered chat already holds its special tokens; raw text gets the model's usual ones.
        ids, spans = self._tokenizer.encode_text(
            text,
            add_special_tokens=not templated,
            offsets=offsets,
            limit=None if max_tokens is None else max_tokens + 1,
        )
        over = max_tokens is not None and len(ids) > max_tokens
        return Encoding(ids, text, spans, self.token_strings(ids) if tokens else [], truncated=over, chars=len(text))

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        tokenizer = self._tokenizer.reader()
        return [str(tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)) for i in ids]
