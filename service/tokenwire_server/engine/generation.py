"""One request's life inside an engine, shared by the engines that run on torch.

A ``Generation`` receives the tokens the engine picks for it, runs them through the
text stream (detokenizer + stop matcher), decides when the request is finished
(end of sequence, length, stop sequence, time limit) and sends the events to the
caller's sink. The engines only decide *how* tokens are computed.
"""

from __future__ import annotations

import collections
import os
import time
from typing import TYPE_CHECKING, Any

from ..domain import (
    Alternative,
    ErrorEvent,
    ErrorKind,
    EventSink,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidResume,
    RequestHandle,
    StreamReader,
    TextEvent,
    TokenInfo,
    Usage,
)
from ..structured import STUCK, Constraint
from ..text import SharedTokenizer, TextStream

if TYPE_CHECKING:
    import torch


class Generation:
    def __init__(
        self,
        request: GenerationRequest,
        handle: RequestHandle,
        sink: EventSink,
        tokenizer: Any,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        constraint: Constraint | None = None,
        reader: StreamReader | None = None,
    ) -> None:
        self.request = request
        # The request's LoRA adapter as its engine applies it (None: the base model), and the
        # key its prefix-cache chains start from (each adapter's own: its K/V differ).
        self.adapter: Any = None
        self.prefix_root = b""
        # How far behind the caller is in reading this stream's events (None: it reads as they
        # come, e.g. a test's recorder): the engine parks the stream when it falls too far behind.
        self.reader = reader
        # Constrained decoding (request.response_format): the sampler masks this row with
        # it, and each token taken advances it; the answer ends when it is complete.
        self.constraint = constraint
        self.handle = handle
        self._sink = sink
        self._tokenizer = tokenizer
        self._eos = frozenset(eos_token_ids)
        self.text = TextStream(tokenizer, request.stop_sequences, request.include_stop_sequence)
        self.generated: list[int] = []
        self._pending_tokens: list[TokenInfo] = []
        # Tokens taken and not yet delivered (``take``/``deliver``), and how the request ends on
        # the last of them, if it does: a finish, or why the token broke its grammar (a fault).
        self._taken: list[tuple[int, float | None, tuple[Alternative, ...], tuple[Alternative, ...]]] = []
        self._ending: FinishReason | None = None
        self._broken: str | None = None
        self._stuck = False  # ``_broken`` because no token could continue the format (the caller's)
        self._released = False  # a resume cut just after its quiet stop token: all its text was sent
        self._counts: collections.Counter[int] = collections.Counter()  # generated_counts
        self._counted = 0
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished = False
        self.cached_prompt_tokens = 0  # prompt tokens an engine found in its prefix cache
        # Times it left its slot to be read again later: its slot taken for a more deserving
        # request, or parked while its reader caught up (``parks`` of them).
        self.preemptions = 0
        self.parks = 0
        # What the model reads before its first pick: the prompt, and a resumed stream's tokens
        # (built once: the scheduler slices it for every prompt chunk).
        resumed = request.resume_ids
        self.context_ids: list[int] = request.prompt_ids + list(resumed) if resumed else request.prompt_ids
        # The scored prompt (request.prompt_logprobs): a TokenInfo per prompt token, the first without a
        # logprob (nothing comes before it), the others filled by ``score_prompt`` as the engine reads
        # the prompt; sent once, with the first event (``_prompt_out``).
        self._prompt_scores: list[TokenInfo | None] | None = None
        if request.prompt_logprobs and request.prompt_ids:
            first = request.prompt_ids[0]
            self._prompt_scores = [TokenInfo(first, self.token_text(first))] + [None] * (len(request.prompt_ids) - 1)
        seed = request.sampling.seed
        # The sampler's noise is a function of (seed, step): an unseeded request draws its own seed.
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        # A resumed stream (``request.resume_ids``): how the uncut stream would have ended at
        # the cut, if it would have (None: it goes on).
        self.ended_at_cut: FinishReason | None = self._replay(request.resume_ids)

    def _replay(self, ids: tuple[int, ...]) -> FinishReason | None:
        """Bring the text stream to the state the caller's tokens leave it in, sending nothing.

        The caller has received exactly the text these tokens released: the detokenizer and
        the stop matcher hold back the same partial character or possible stop start now as
        they did when the stream was cut, so what comes next repeats nothing and loses nothing.
        """
        constraint = self.constraint
        for i, token_id in enumerate(ids):
            if constraint is not None and not constraint.accept(token_id):
                raise InvalidResume(
                    f"token {i} (id {token_id}) does not follow the request's response_format: "
                    "these are not the tokens this request generated"
                )
            self.generated.append(token_id)
            if i == len(ids) - 1 and self._quiet_stop(token_id):
                # The stream ended on this stop token: its text was never sent, and its finish
                # released all the text held before it. A resume there sends nothing more.
                self._released = True
                break
            _, stopped = self.text.push(token_id)
            if stopped:
                return FinishReason.STOP_SEQUENCE
        return self._ends_after(ids[-1] if ids else None)

    def _ends_after(self, last: int | None) -> FinishReason | None:
        """How the request ends on its tokens so far, ``last`` the latest (None: none yet), if it
        does: its grammar complete (min_new_tokens/ignore_eos do not apply), end of sequence, or
        length. Stop sequences are the text stream's to find."""
        if self.constraint is not None and self.constraint.terminated:
            return FinishReason.EOS
        if last is None:
            return None
        if last in self.request.stop_token_ids and self.eos_allowed:
            return FinishReason.STOP_TOKEN
        if last in self._eos and not self.request.ignore_eos and self.eos_allowed:
            return FinishReason.EOS
        if len(self.generated) >= self.request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # -- state the engines look at -------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def context_len(self) -> int:
        return len(self.context_ids)

    @property
    def total_len(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)

    @property
    def budget_tokens(self) -> int:
        """Most KV-cache tokens this request can come to hold (max_new_tokens fits the context)."""
        return self.prompt_len + self.request.max_new_tokens

    @property
    def eos_allowed(self) -> bool:
        return len(self.generated) >= self.request.min_new_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether the engine should score the prompt as it reads it: asked, and no token out yet (a
        prompt read again after a preemption or a park, tokens in hand, was scored the first time)."""
        return self._prompt_scores is not None and self.first_token_at is None

    def score_prompt(self, position: int, infos: list[TokenInfo]) -> None:
        """The scores of prompt tokens ``position + 1 ...``: what the logits at ``position ...`` give them."""
        scores = self._prompt_scores
        if scores is None:
            return
        for i, info in enumerate(infos, start=position + 1):
            if i < len(scores):
                scores[i] = info

    def _prompt_out(self) -> tuple[TokenInfo, ...]:
        """The scored prompt, once (with the request's first event); nothing when not asked or sent."""
        scores, self._prompt_scores = self._prompt_scores, None
        if scores is None:
            return ()
        # Every position is scored before the first pick (the engines read the whole prompt first);
        # a gap would be a bug: it shows as a token without a logprob, never as a failed call.
        ids = self.request.prompt_ids
        return tuple(info or TokenInfo(ids[i], self.token_text(ids[i])) for i, info in enumerate(scores))

    def seen_ids(self) -> list[int]:
        return self.request.prompt_ids + self.generated

    def generated_counts(self) -> collections.Counter[int]:
        """How many times each token was generated so far (the frequency and presence penalties'
        input), kept up to date as tokens come rather than counted again every step."""
        if len(self.generated) < self._counted:  # the tokens were replaced (tests): count again
            self._counts, self._counted = collections.Counter(), 0
        self._counts.update(self.generated[self._counted :])
        self._counted = len(self.generated)
        return self._counts

    def mark_admitted(self, now: float | None = None) -> None:
        """Admitted into a slot; after a preemption, the first admission still counts (queue
        time, time limit)."""
        if self.admitted_at is None:
            self.admitted_at = time.monotonic() if now is None else now

    def preempt(self) -> None:
        """Its slot and blocks were taken for another request: when admitted again, the engine
        reads the prompt and every token generated so far, and goes on from there as a
        resumed stream does (same sampler step, stop matcher and detokenizer state)."""
        self.context_ids = self.request.prompt_ids + self.generated
        self.preemptions += 1

    def park(self) -> None:
        """Its reader fell behind: it gives its slot and blocks up until the reader catches up,
        then comes back as a preempted request does, with the same tokens."""
        self.context_ids = self.request.prompt_ids + self.generated
        self.preemptions += 1
        self.parks += 1

    def expired(self, now: float) -> ErrorKind | FinishReason | None:
        """Whether the deadline or the time limit has passed (checked between steps)."""
        request = self.request
        if request.deadline is not None and now >= request.deadline:
            return ErrorKind.DEADLINE
        if request.time_limit_s is not None and self.admitted_at is not None:
            if now - self.admitted_at >= request.time_limit_s:
                return FinishReason.TIME_LIMIT
        return None

    # -- tokens in, events out -----------------------------------------------------

    def add_token(
        self,
        token_id: int,
        logprob: float | None = None,
        top: tuple[Alternative, ...] = (),
        named: tuple[Alternative, ...] = (),
    ) -> bool:
        """Take one generated token and deliver it; return True when the request is now finished."""
        self.take(token_id, logprob, top, named)
        return self.deliver()

    def take(
        self,
        token_id: int,
        logprob: float | None = None,
        top: tuple[Alternative, ...] = (),
        named: tuple[Alternative, ...] = (),
    ) -> bool:
        """Commit a token without delivering it: what the next step's sampler reads (the tokens
        so far, the grammar's state) is up to date, and whether the request ends on it by end of
        sequence, length or its grammar is known. A token that ends it is delivered at once;
        otherwise its text, stop matching and events wait for ``deliver`` (an engine that
        overlaps steps delivers while the device runs the next one). Return True when finished.
        A stop sequence is found only by delivery: until then the request may take one more.
        A scoring call (max_new_tokens 0) ends here, its prompt read: the pick is not its token."""
        if self.request.max_new_tokens == 0:
            self.finish(FinishReason.LENGTH)
            return True
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self._prompt_done()
        self.generated.append(token_id)
        self._taken.append((token_id, logprob, top, named))
        if self._broken is not None:  # the grammar failed while this token was drawn (grammar_failed)
            return self.deliver()
        if self.constraint is not None and not self.constraint.accept(token_id):
            if not self.constraint.can_continue():
                self._stuck = True  # every token was masked out: the caller's format cannot go on
            self._broken = f"token {token_id} breaks the response format"  # else the sampler masked it out: a bug
        else:
            self._ending = self._ends_after(token_id)
        return self.deliver() if self._ending is not None or self._broken is not None else False

    def grammar_failed(self, error: BaseException) -> None:
        """The response format's grammar could not give this row's next tokens (a library
        error): the row ends INTERNAL with the token being drawn, unmasked, which is never
        sent; the step's other rows are not touched."""
        self._broken = f"the response format's grammar failed: {type(error).__name__}: {error}"

    def deliver(self) -> bool:
        """Send what the tokens taken since the last delivery release: text through the detokenizer
        and the stop matcher, and the finish their ending decided. Return True when finished."""
        taken, self._taken = self._taken, []
        if self.finished or not taken:
            return self.finished
        request = self.request
        want_tokens = request.want_tokens or request.want_logprobs or request.top_logprobs
        text = ""
        quiet = self._ending is FinishReason.STOP_TOKEN and self._quiet_stop(taken[-1][0])
        for n, (token_id, logprob, top, named) in enumerate(taken, start=1):
            # NOTE: a TokenInfo (and its text) only for a caller that asked for token info (ids or
            # logprobs; a client that resumes asks for ids). Nothing else reads them but the
            # transport's count of a cut stream's tokens for the quota, which without them counts a
            # chunk as one token: a chunk after a held-back character (two tokens) is undercharged
            # by one. A token count on TextEvent would make that exact at no decode.
            if want_tokens:
                self._pending_tokens.append(TokenInfo(token_id, self.token_text(token_id), logprob, top, named))
            if quiet and n == len(taken):
                break
            piece, stopped = self.text.push(token_id)
            text += piece
            if stopped:
                self.finish(FinishReason.STOP_SEQUENCE, text)
                return True
        if self._broken is not None:
            if self._stuck:
                self.fail(ErrorKind.FORMAT_DEAD_END, STUCK)
            else:
                self.fail(ErrorKind.INTERNAL, self._broken)
            return True
        if self._ending is not None:
            self.finish(self._ending, text)
            return True
        prompt = self._prompt_out()
        if text or self._pending_tokens or prompt:
            # A caller that asked for tokens gets each one in the step that made it, even
            # when its text is not out yet (a special token, part of a UTF-8 character, the
            # possible start of a stop sequence): the stream's timing is the engine's.
            tokens, self._pending_tokens = tuple(self._pending_tokens), []
            self._sink(TextEvent(text, tokens, prompt))
        return False

    def _quiet_stop(self, token_id: int) -> bool:
        """Whether ``token_id``, just taken, ends the request as a stop token whose text is left
        out (as a stop sequence's is, unless the caller keeps stops)."""
        request = self.request
        return token_id in request.stop_token_ids and self.eos_allowed and not request.include_stop_sequence

    def token_text(self, token_id: int) -> str:
        """A token's own text (``TokenInfo``, the top alternatives): asked only for a caller that
        wants token info; the engines' ``SharedTokenizer`` keeps each token's from its first decode."""
        tokenizer = self._tokenizer
        if isinstance(tokenizer, SharedTokenizer):
            return tokenizer.token_text(token_id)
        return str(tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def finish(self, reason: FinishReason, text: str = "") -> None:
        if self.finished:
            return
        tail, stopped = ("", False) if self._released else self.text.finish()
        if stopped and reason is not FinishReason.STOP_SEQUENCE:
            reason = FinishReason.STOP_SEQUENCE
        self.finished = True
        now = time.monotonic()
        arrival = self.request.arrival
        admitted = self.admitted_at if self.admitted_at is not None else now
        first = self.first_token_at if self.first_token_at is not None else now
        usage = Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=len(self.generated),
            queue_time_s=admitted - arrival,
            time_to_first_token_s=first - arrival,
            total_time_s=now - arrival,
            cached_prompt_tokens=min(self.cached_prompt_tokens, self.prompt_len),
        )
        tokens, self._pending_tokens = tuple(self._pending_tokens), []
        matched: str | int | None = None
        if reason is FinishReason.STOP_SEQUENCE:
            matched = self.text.stops.matched
        elif reason in (FinishReason.STOP_TOKEN, FinishReason.EOS) and self.generated:
            matched = self.generated[-1]
        self._sink(FinishEvent(text + tail, tokens, reason, usage, matched, self._prompt_out()))
        self.handle.done.set()
        self._prompt_done()

    def fail(self, kind: ErrorKind, message: str) -> None:
        if self.finished:
            return
        self.finished = True
        self._sink(ErrorEvent(kind, message))
        self.handle.done.set()
        self._prompt_done()

    def abandon(self) -> None:
        """The caller cancelled: stop without an event (nobody is listening)."""
        self.finished = True
        self.handle.done.set()
        self._prompt_done()

    def _prompt_done(self) -> None:
        """Sample 0 of an n-call has read its prompt (or ended): the other samples may start."""
        if self.request.prompt_read is not None:
            self.request.prompt_read.set()
