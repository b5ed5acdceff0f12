"""The batched engine's scheduler: admission, block tables, each step's plan, and the
delivery of its tokens. Plain Python, no torch (tested without a model).

One step of the engine is ``schedule()`` → the runner's ``run(plan)`` → ``postprocess``:

- ``admit`` moves waiting requests into rows while the block pool can promise each
  its worst case (``blocks.BlockPool``), sharing the cached blocks of its prompt's
  longest cached prefix: a row starts at the first column it has to read.
- ``schedule`` plans one forward pass: every decoding row's next token and, while
  anyone decodes, up to ``max_prefill_tokens`` tokens of waiting prompts (chunked
  prefill, a token at column c counting ``1 + c / span_columns``); with nobody
  decoding, up to ``IDLE_PREFILL_TOKENS``. A row that just took its slot by preemption
  (``Row.urgent``) has its short prompt read alone first. Each part gets the blocks it writes to.
  Nothing about a row changes until ``postprocess``: a plan that fails (out of memory)
  is planned again without its newest row, and the others get the same tokens.
- ``postprocess`` commits the plan: lengths move, full blocks (prompt and generated) are
  published to the prefix cache, and every picked token goes to its request, here and nowhere else.
- ``retire`` drops finished, cancelled and (between steps) expired rows; their blocks
  go back to the pool at once. A row whose reader has fallen behind is parked: it gives its
  slot and blocks up (as a preempted row does) and waits, outside the queue, for its reader
  to catch up (``AdmissionQueue.park``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..domain import ErrorKind, FinishReason
from .blocks import BlockPool, Lease, next_key, prefix_keys

if TYPE_CHECKING:
    from .admission import AdmissionQueue
    from .generation import Generation

# With no stream decoding, waiting prompts are read at once, but at most this many
# prompt tokens per forward pass (bounds the attention matrix of a very long prompt).
IDLE_PREFILL_TOKENS = 2048


@dataclasses.dataclass
class Row:
    """One admitted request: its blocks, and how far its keys and values go."""

    seq: Generation
    lease: Lease
    # Prefix keys of its full blocks: the context's at admission, then each generated block's as it
    # fills (empty with the prefix cache off).
    keys: list[bytes]
    length: int = 0  # tokens whose keys/values are written
    decoding: bool = False  # the prompt is read; the next token is ``last``
    last: int = 0
    published: int = 0  # leading blocks in the prefix cache
    # Took its slot by preemption (a HIGH call, or a tenant below its share): its short prompt
    # is read alone in the next step, so its first token waits for one light step, not a
    # full batch's (the other rows skip that one step).
    urgent: bool = False
    # Left the scheduler (finished, cancelled, expired, failed or preempted; its blocks are
    # back in the pool): a step launched before that commits nothing for it.
    left: bool = False

    @property
    def table(self) -> list[int]:
        return self.lease.blocks


@dataclasses.dataclass(frozen=True)
class Part:
    """``count`` tokens of one row in a step, from column ``start``: its next token (``decodes``) or a prompt chunk."""

    row: Row
    start: int
    count: int
    decodes: bool

    @property
    def ids(self) -> list[int]:
        if self.decodes:
            return [self.row.last]
        return self.row.seq.context_ids[self.start : self.start + self.count]

    @property
    def scored(self) -> range:
        """The positions whose logits score the next prompt token (``Generation.score_prompt``): in a
        prompt chunk of a row that scores its prompt, those before the prompt's last token."""
        seq = self.row.seq
        if self.decodes or not seq.scores_prompt:
            return range(0)
        return range(self.start, min(self.start + self.count, seq.prompt_len - 1))

    @property
    def emits(self) -> bool:
        """Whether this part ends with a token to pick (a decode, or a prompt's last chunk)."""
        return self.decodes or self.start + self.count == self.row.seq.context_len


@dataclasses.dataclass
class Plan:
    """One forward pass: one-token parts first (decodes, then one-token chunks), then longer chunks."""

    parts: list[Part]
    prompt_tokens: int

    @property
    def rows(self) -> list[Row]:
        return [part.row for part in self.parts]

    @functools.cached_property
    def emitters(self) -> list[Row]:
        """The rows that pick a token, in plan order; fixed when first read (at launch), so a
        row preempted before its step is collected still lines up with its pick."""
        return [part.row for part in self.parts if part.emits]

    @property
    def decodes(self) -> int:
        return sum(1 for part in self.parts if part.decodes)


class Scheduler:
    """Rows in admission order over a block pool; the engine's loop drives it."""

    def __init__(
        self,
        queue: AdmissionQueue,
        pool: BlockPool,
        max_active: int,
        max_prefill_tokens: int,
        span_columns: float,
        batch_window_s: float,
        on_admit: Callable[[list[Generation]], None] = lambda group: None,
        on_preempt: Callable[[Generation], None] = lambda seq: None,
        on_park: Callable[[Generation], None] = lambda seq: None,
        behind: Callable[[Generation], bool] = lambda seq: False,
    ) -> None:
        self.queue = queue  # base.AdmissionQueue
        self.pool = pool
        self.max_active = max_active
        self.max_prefill_tokens = max_prefill_tokens
        self.span_columns = span_columns
        self.batch_window_s = batch_window_s
        self._on_admit = on_admit
        self._on_preempt = on_preempt
        self._on_park = on_park
        self._behind = behind  # whether a row's reader has fallen behind (AdmissionQueue.behind)
        self.rows: list[Row] = []
        self._last_busy_rows = 0  # most rows in the batch since it was last empty

    # -- admission -------------------------------------------------------------------

    def admit(self, wait: bool = True) -> None:
        """Admit waiting requests while the pool can promise them their worst case. With no
        row running it blocks until one arrives, unless ``wait`` is off (a step in flight
        still has to be collected)."""
        room = self.max_active - len(self.rows)
        preempted = False
        if room <= 0:
            preempted = self.preempt() is not None
            room = self.max_active - len(self.rows)
        if room <= 0:
            return
        busy = bool(self.rows) or not wait
        pool = self.pool
        leases: dict[int, tuple[Lease, list[bytes]] | None] = {}

        def fits(seq: Generation) -> bool:
            if id(seq) in leases:
                return True
            after = seq.request.after_prompt
            if after is not None and not after.is_set():
                # A sample of an n-call waits until sample 0 has read the prompt, to find its blocks
                # cached (GenerateRequest.n): a step or a few; the requests behind it wait with it.
                return False
            if seq.prompt_len == 0 or not pool.fits_ever(seq.budget_tokens):
                leases[id(seq)] = None  # taken, to be failed: it can never run
                return True
            # A resumed stream reads its prompt and the tokens it already has (``context_ids``):
            # the prompt's blocks are often still cached from before the cut.
            keys = prefix_keys(seq.context_ids, pool.block_size, seq.prefix_root) if pool.prefix_cache else []
            # A row that scores its prompt reads all of it (a cached block has no logits); it still
            # publishes its blocks for others.
            lease = pool.lease(seq.budget_tokens, [] if seq.scores_prompt else keys, seq.context_len)
            if lease is None:
                return False
            leases[id(seq)] = (lease, keys)
            return True

        group = self.queue.dequeue(fits, block=not busy, max_count=room)
        if not group:
            return
        if not busy and (self._last_busy_rows > 1 or len(group) > 1):
            # Under concurrent load, a batch that starts from empty waits a moment for the
            # requests still arriving, so they share one prefill instead of each stalling
            # the others later (a dynamic batcher's queue delay). A lone stream never waits.
            # The window restarts with each arrival: gather while requests keep coming.
            while len(group) < room and self.queue.wait_for_arrival(self.batch_window_s):
                more = self.queue.dequeue(fits, block=False, max_count=room - len(group))
                if not more:  # the next one does not fit the pool: start with what we have
                    break
                group += more
        self._on_admit(group)
        if not self.rows:
            self._last_busy_rows = 0
        for seq in group:
            taken = leases[id(seq)]
            if taken is None:
                if seq.prompt_len == 0:  # the transport never sends one; nothing to read, nothing to predict from
                    seq.fail(ErrorKind.INTERNAL, "the prompt has no tokens")
                else:  # only possible when the KV budget is below the context
                    seq.fail(
                        ErrorKind.INTERNAL,
                        f"the request needs {seq.budget_tokens} KV-cache tokens, more than the whole budget "
                        f"({pool.num_blocks * pool.block_size}, --kv-cache-tokens)",
                    )
                self.queue.vacate(seq)
                continue
            lease, keys = taken
            if not seq.preemptions:  # coming back, its prompt was read (or found) when first admitted
                seq.cached_prompt_tokens = lease.cached_tokens
            shared = lease.cached_tokens // pool.block_size
            urgent = (
                preempted and not seq.preemptions and seq.context_len - lease.cached_tokens <= self.max_prefill_tokens
            )
            self.rows.append(Row(seq, lease, keys, length=lease.cached_tokens, published=shared, urgent=urgent))
        self._last_busy_rows = max(self._last_busy_rows, len(self.rows))

    # -- planning --------------------------------------------------------------------

    def _next_chunks(self, decoding: bool) -> tuple[list[tuple[Row, int]], int]:
        """The next chunks of waiting prompts, in admission order, and their token count."""
        budget = self.max_prefill_tokens if decoding else max(IDLE_PREFILL_TOKENS, self.max_prefill_tokens)
        chunks: list[tuple[Row, int]] = []
        used = 0
        spent = 0.0
        for row in self.rows:
            if row.decoding:
                continue
            weight = 1.0 + row.length / self.span_columns if decoding else 1.0
            count = min(row.seq.context_len - row.length, int((budget - spent) / weight))
            if count <= 0:
                if not chunks:  # however deep the prompt, it moves at least a token a step
                    chunks.append((row, 1))
                    used = 1
                break
            chunks.append((row, count))
            used += count
            spent += count * weight
        return chunks, used

    def schedule(self) -> Plan | None:
        """The next step's plan (None: nothing to run); each part's blocks are taken from its promise."""
        urgent = next(
            (row for row in self.rows if row.urgent and not row.decoding and row.length < row.seq.context_len), None
        )
        if urgent is not None:  # its whole prompt, alone (see Row.urgent)
            part = Part(urgent, urgent.length, urgent.seq.context_len - urgent.length, False)
            self.pool.grow(urgent.lease, part.start + part.count)
            return Plan([part], part.count)
        decoding = [row for row in self.rows if row.decoding]
        chunks, used = self._next_chunks(decoding=bool(decoding))
        if not decoding and not chunks:
            return None
        parts = [Part(row, row.length, 1, True) for row in decoding]
        parts += [Part(row, row.length, count, False) for row, count in chunks if count == 1]
        parts += [Part(row, row.length, count, False) for row, count in chunks if count > 1]
        for part in parts:
            self.pool.grow(part.row.lease, part.start + part.count)
        return Plan(parts, used)

    # -- after the step ----------------------------------------------------------------

    def postprocess(
        self, plan: Plan, picks: list[tuple[int, float | None, Any, Any]], scores: dict[int, list[Any]] | None = None
    ) -> None:
        """Commit a step that ran: lengths, the prefix cache, and each picked token to its request."""
        self.deliver(self.take(plan, picks, scores))
        self.retire(expire=False)

    def take(
        self, plan: Plan, picks: list[tuple[int, float | None, Any, Any]], scores: dict[int, list[Any]] | None = None
    ) -> list[Row]:
        """Commit a step's lengths, prefix-cache blocks, prompt scores (``scores``: per part index, the
        ``TokenInfo``s of its ``scored`` positions) and picked tokens (``Generation.take``) without
        delivering their text; the rows whose token waits for ``deliver`` come back. Rows that left
        since the step was launched commit nothing (their pick is dropped)."""
        for index, part in enumerate(plan.parts):
            row = part.row
            if not part.decodes and not row.left:
                row.length += part.count
                self._publish_written(row)
                if scores and index in scores:
                    row.seq.score_prompt(part.start, scores[index])
        waiting: list[Row] = []
        for row, (token, logprob, top_alternatives, named) in zip(plan.emitters, picks, strict=True):
            if row.left:
                continue
            if row.decoding:
                row.length += 1
                self._publish_written(row)
            row.decoding, row.last, row.urgent = True, token, False
            if (
                not row.seq.finished
                and not row.seq.handle.cancelled
                and not row.seq.take(token, logprob, top_alternatives, named)
            ):
                waiting.append(row)
        return waiting

    def _publish_written(self, row: Row) -> None:
        """Publish every full block of ``row`` whose keys and values are written: prompt blocks,
        and generated ones too (keyed as they fill), so that a stream resumed here, or the row
        itself coming back after a preemption or a park, reads only its last partial block.

        NOTE: column ``c`` of a row holds token ``c`` of its prompt + generated tokens, and no
        step writes into a full block again (a step writes column ``row.length``), so a key
        names exactly what its block holds. It costs one BLAKE2b of 16 ids per 16 tokens."""
        pool = self.pool
        full = row.length // pool.block_size
        if not pool.prefix_cache or full <= row.published:
            return
        if len(row.keys) < full:
            size, first = pool.block_size, len(row.keys)
            prompt, generated = row.seq.request.prompt_ids, row.seq.generated
            start, end = first * size, full * size
            tokens = prompt[start:end] + generated[max(0, start - len(prompt)) : max(0, end - len(prompt))]
            for i in range(full - first):
                previous = row.keys[-1] if row.keys else row.seq.prefix_root
                row.keys.append(next_key(previous, tokens[i * size : (i + 1) * size]))
        while row.published < full:
            pool.publish(row.lease, row.published, row.keys[row.published])
            row.published += 1

    def deliver(self, rows: list[Row]) -> None:
        """Deliver the tokens ``take`` committed for ``rows`` (text, stop sequences, events)."""
        for row in rows:
            row.seq.deliver()

    def retire(self, expire: bool) -> None:
        """Drop finished, cancelled and (between steps) expired requests; their blocks free at once.
        Park the rows whose readers have fallen behind; between steps, end the parked streams
        whose readers have not come back (``--stalled-reader-timeout``)."""
        now = time.monotonic()
        if expire:
            self.queue.expire_parked(now)
        gone: list[Row] = []
        behind: list[Row] = []
        for row in self.rows:
            seq = row.seq
            if not seq.finished and seq.handle.cancelled:
                seq.abandon()
            elif not seq.finished and expire:
                expired = seq.expired(now)
                if expired is ErrorKind.DEADLINE:
                    seq.fail(ErrorKind.DEADLINE, "the call's deadline passed during generation")
                elif expired is FinishReason.TIME_LIMIT:
                    seq.finish(FinishReason.TIME_LIMIT)
            if seq.finished:
                gone.append(row)
            elif self._behind(seq):
                behind.append(row)
        self.leave(gone)
        for row in behind:
            self.park(row, now)

    def park(self, row: Row, now: float | None = None) -> None:
        """``row``'s reader has left ``stream_backlog`` events unread: it stops decoding and gives its
        slot and blocks to others, like a preempted row, but waits outside the queue until the
        reader has caught up (``AdmissionQueue.park``); then it is read again (prompt + tokens so
        far, its written blocks found in the prefix cache unless evicted) and goes on with the
        tokens it would have had. A step launched with it commits nothing for it (``left``)."""
        self._set_aside(row)
        row.seq.park()
        self.queue.park(row.seq, now)
        self._on_park(row.seq)

    def _set_aside(self, row: Row) -> None:
        """Take ``row`` out of the batch to be read again later (preempted or parked) and give its
        blocks back. Every full block it wrote is in the prefix cache already (``_publish_written``),
        so when it comes back it finds them (unless evicted meanwhile) and reads only its last
        partial block."""
        self.rows.remove(row)
        row.left = True
        self.pool.give_back(row.lease)

    def preempt(self) -> Row | None:
        """Every slot is taken and a waiting request deserves one more than a running request
        (``AdmissionQueue.victim``: priority, then fair share): that request's least urgent,
        least advanced row gives up its slot and blocks, and goes back to the front of its
        tenant's queue, to be read again (prompt + tokens so far) when admitted again."""
        victim = self.queue.victim()
        if victim is None:
            return None
        tenant, least_urgent = victim
        rows = [
            row
            for row in self.rows
            if row.seq.request.tenant == tenant and row.seq.request.priority >= least_urgent and not row.seq.finished
        ]
        if not rows:
            return None
        row = max(rows, key=lambda r: (r.seq.request.priority, -len(r.seq.generated)))
        self._set_aside(row)
        row.seq.preempt()
        self.queue.requeue(row.seq)
        self._on_preempt(row.seq)
        return row

    def leave(self, rows: list[Row]) -> None:
        """Give the rows' blocks back and release their admission."""
        if not rows:
            return
        leaving = {id(row) for row in rows}
        self.rows = [row for row in self.rows if id(row) not in leaving]
        for row in rows:
            row.left = True
            self.pool.give_back(row.lease)
        self.queue.vacate(*(row.seq for row in rows))

    def running(self) -> list[tuple[Any, int]]:
        return [(row.seq.request, len(row.seq.generated)) for row in list(self.rows)]
