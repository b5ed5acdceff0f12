"""The admission queue: who waits, who goes next, who is parked (no torch).

At most ``max_active`` requests generate at once and at most ``max_queue`` wait; past
that, ``put`` refuses at once, before any work. Which waiting request goes next is fair
between tenants (``AdmissionQueue``); a stream whose reader falls ``stream_backlog``
events behind is parked here until its reader catches up (module ``base``'s docstring).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..domain import (
    EngineClosed,
    EngineOverloaded,
    ErrorKind,
    Priority,
    TenantLoad,
    TenantOverLimit,
)
from ..tenancy import TenantPolicy, Tenants
from .generation import Generation

if TYPE_CHECKING:
    from .memory import DeviceMemory

__all__ = ["AdmissionQueue", "EngineLimits", "cost_of"]


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_active: int
    max_queue: int
    kv_cache_tokens: int
    retry_after_s: float = 0.5
    max_prefill_tokens: int = 20
    batch_window_s: float = 0.01
    tenants: Tenants = dataclasses.field(default_factory=Tenants)
    # Flow control: a stream whose reader leaves this many events unread is parked until it
    # has read all but a quarter of them (``--stream-backlog-chunks``) ...
    stream_backlog: int = 256
    # ... and a stream parked this long with nothing read ends STALLED_READER (0: never;
    # ``--stalled-reader-timeout``).
    stalled_reader_timeout_s: float = 30.0
    # With ``kv_cache_tokens`` 0 on a GPU: the device whose memory the batched engine sizes its KV
    # pool from, once it has measured its worst step (``memory``); it then sets ``kv_cache_tokens``.
    kv_memory: DeviceMemory | None = None

    @property
    def resume_backlog(self) -> int:
        """The unread events at or below which a parked stream goes back to the queue."""
        return self.stream_backlog // 4

    @property
    def max_parked(self) -> int:
        """Most streams parked at once: as many as may run and wait. Past it the one whose
        reader has been idle longest ends STALLED_READER, so memory stays bounded however many
        callers stop reading."""
        return max(1, self.max_active + self.max_queue)


class _Lane:
    """One tenant's side of the admission queue: its waiting requests by priority, its
    running count, and its virtual finish tag (weighted fair queuing)."""

    def __init__(self, policy: TenantPolicy) -> None:
        self.policy = policy
        self.waiting: tuple[collections.deque[Generation], ...] = tuple(collections.deque() for _ in Priority)
        self.running = [0 for _ in Priority]
        self.tag = 0.0  # virtual time at which its last admitted request's share ends

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.waiting)

    @property
    def active(self) -> int:
        return sum(self.running)

    def at_active_limit(self) -> bool:
        return 0 < self.policy.max_active <= self.active


def cost_of(seq: Generation) -> int:
    """What admitting ``seq`` charges its tenant's share: the tokens it may compute."""
    request = seq.request
    return len(request.prompt_ids) + len(request.resume_ids) + request.max_new_tokens


class AdmissionQueue:
    """Requests waiting for a slot, bounded; the engine's own thread(s) take from it.

    Which waiting request goes next (``dequeue``): the most urgent priority first, across all
    tenants; within a priority, a tenant running fewer than its weighted share of the slots
    (among the tenants with work) before one running its share or more, since every
    running stream decodes a token a step, the share of slots is the share of tokens;
    between tenants alike in that, weighted fair queuing by tokens (start-time fair
    queuing: each admission advances its tenant's tag by the tokens it may compute over
    the tenant's weight, and the lowest tag goes next; a tenant that was idle starts at the
    current virtual time, so it banks no credit); within a tenant and priority, arrival
    order. What a request did not generate is given back to its tenant's tag when it leaves.

    Bounds (``put``): a tenant at its own ``max_queued`` is refused (``TenantOverLimit``).
    Past the server's ``max_active + max_queue``, only a tenant holding less than its
    weighted share of ``max_queue`` is still queued, so one tenant that fills the queue
    cannot lock the others out; the queue then holds at most about twice ``max_queue``.
    """

    # How often parked streams are looked at for their stall timeout (at most).
    SWEEP_INTERVAL_S = 0.1

    def __init__(self, limits: EngineLimits, on_stalled: Callable[[Generation], None] = lambda seq: None) -> None:
        self._limits = limits
        self._tenants = limits.tenants
        self._lanes: dict[str, _Lane] = {}
        self._active = 0
        self._queued = 0
        self._vtime = 0.0  # the system's virtual time: the start tag of the last admission
        self._closed = False
        self._refusal: EngineClosed = EngineClosed("the engine is shutting down")
        self._cond = threading.Condition()
        # Parked streams (their readers fell behind) -> when parked, oldest first. They count
        # as neither active nor queued: no slot, no queue place, nothing in the fair shares or
        # in the start estimate that refuses callers (see ``park``).
        self._parked: dict[Generation, float] = {}
        self._next_sweep = 0.0
        self._on_stalled = on_stalled

    def _lane(self, tenant: str) -> _Lane:
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = _Lane(self._tenants.policy(tenant))
        return lane

    def _present(self, joining: _Lane | None = None) -> list[_Lane]:
        """The tenants with work here (running or waiting), and ``joining``: those that shares are taken among."""
        return [other for other in self._lanes.values() if other.queued or other.active or other is joining]

    def _queue_share(self, lane: _Lane) -> int:
        """``lane``'s weighted share of ``max_queue`` among the tenants with work here."""
        total = sum(other.policy.weight for other in self._present(lane))
        return max(1, int(self._limits.max_queue * lane.policy.weight / total))

    def put(self, seq: Generation, check: Callable[[int | None], None] | None = None) -> None:
        """Queue ``seq``, or raise: EngineClosed, EngineOverloaded when full (TenantOverLimit for
        its tenant's own limit), or whatever ``check(ahead)`` raises once there is room
        (deadline-aware admission): ``ahead`` is how many waiting requests go first, None
        when ``seq`` takes a slot at once by preempting one."""
        request = seq.request
        with self._cond:
            if self._closed:
                raise self._refusal
            limits = self._limits
            lane = self._lane(request.tenant)
            policy = lane.policy
            if 0 < policy.max_queued <= lane.queued:
                raise TenantOverLimit(
                    f"tenant {request.tenant!r} has {lane.queued} requests waiting, its limit (max_queued); "
                    "retry later",
                    limits.retry_after_s,
                    request.tenant,
                    "max_queued",
                )
            full = self._active + self._queued >= limits.max_active + limits.max_queue
            if full and self._drop_cancelled():
                full = self._active + self._queued >= limits.max_active + limits.max_queue
            if full and (len(self._lanes) == 1 or lane.queued >= self._queue_share(lane)):
                raise EngineOverloaded(
                    f"server is full: {self._active} active and {self._queued} queued requests "
                    f"(limits {limits.max_active} + {limits.max_queue}); retry later or on another replica",
                    limits.retry_after_s,
                )
            if check is not None:
                check(
                    None if self._preempts_at_once(lane, request.priority) else self._ahead_of(lane, request.priority)
                )
            if not lane.queued and not lane.active:
                lane.tag = max(lane.tag, self._vtime)  # back from idle: no banked credit
            lane.waiting[request.priority].append(seq)
            self._queued += 1
            self._cond.notify()

    def _drop_cancelled(self) -> int:
        """Drop the waiting requests whose callers cancelled (``dequeue`` would drop them quietly
        when it reaches them): a full queue refuses nobody for a place a cancelled request
        holds, as the samples of an n-call refused whole would until the engine's next step."""
        dropped = 0
        for lane in self._lanes.values():
            for waiting in lane.waiting:
                gone = [seq for seq in waiting if seq.handle.cancelled]
                for seq in gone:
                    waiting.remove(seq)
                    seq.abandon()
                dropped += len(gone)
        self._queued -= dropped
        return dropped

    def _ahead_of(self, lane: _Lane, priority: Priority) -> int:
        """About how many waiting requests are admitted before one of ``lane`` at ``priority``
        arriving now: every more urgent one; its own tenant's at that priority; and of each
        other tenant's, as many as their weight gives them while those go."""
        lanes = self._lanes.values()
        urgent = sum(len(other.waiting[p]) for other in lanes for p in Priority if p < priority)
        mine = len(lane.waiting[priority])
        turns = (mine + 1) / lane.policy.weight
        others = sum(
            min(len(other.waiting[priority]), math.ceil(turns * other.policy.weight))
            for other in lanes
            if other is not lane
        )
        return urgent + mine + others

    def _preempts_at_once(self, lane: _Lane, priority: Priority) -> bool:
        """Whether a request of ``lane`` at ``priority`` arriving now is the next to go and takes
        a running request's slot at once (see ``victim``)."""
        if self._active < self._limits.max_active:
            return False  # a slot is free: no preemption, and ``_ahead_of`` tells the wait
        if any(lane.waiting[p] for p in Priority if p <= priority):
            return False
        if any(other.waiting[p] for other in self._lanes.values() for p in Priority if p < priority):
            return False
        return self._donor(lane, priority) is not None

    def _donor(self, lane: _Lane, priority: Priority) -> tuple[_Lane, Priority] | None:
        """The tenant that gives a slot to ``lane``'s next request at ``priority``, and the least
        urgent priority it may give up (``victim``'s rules); None: nobody."""
        if priority is Priority.HIGH:
            lows = [other for other in self._lanes.values() if other.running[Priority.LOW]]
            if lows:
                return max(lows, key=lambda other: other.tag), Priority.LOW
        present = self._present(lane)
        total = sum(other.policy.weight for other in present)
        slots = self._limits.max_active

        def over(other: _Lane) -> float:
            return other.active - slots * other.policy.weight / total

        if over(lane) >= 0:
            return None
        donors = [
            other
            for other in present
            if other is not lane and over(other) >= 1 and any(other.running[p] for p in Priority if p >= priority)
        ]
        return (max(donors, key=over), priority) if donors else None

    def _below_share(self) -> Callable[[_Lane], bool]:
        """Whether a tenant runs fewer than its weighted share of the slots, among the tenants with work."""
        total = sum(lane.policy.weight for lane in self._present())
        slots = self._limits.max_active
        return lambda lane: lane.active < slots * lane.policy.weight / max(total, lane.policy.weight)

    def _next(self) -> tuple[_Lane, collections.deque[Generation]] | None:
        """The lane and priority queue whose head goes next (see the class doc)."""
        below = self._below_share()
        for priority in Priority:
            ready = [lane for lane in self._lanes.values() if lane.waiting[priority] and not lane.at_active_limit()]
            if ready:
                best = min(ready, key=lambda lane: (not below(lane), lane.tag))
                return best, best.waiting[priority]
        return None

    def dequeue(self, fits: Callable[[Generation], bool], block: bool, max_count: int) -> list[Generation]:
        """Move waiting sequences that ``fits`` accepts, in the order above, to active.

        Stops at the first one that does not fit, so a large request is not starved
        by a stream of small ones. Blocks until there is one when ``block`` is set.
        """
        with self._cond:
            if block:
                while not self._queued and not self._closed:
                    self._cond.wait(timeout=0.5)
                    self._expire_parked(time.monotonic())  # an idle engine still ends stalled readers
            taken: list[Generation] = []
            while len(taken) < max_count:
                picked = self._next()
                if picked is None:
                    break
                lane, waiting = picked
                seq = waiting[0]
                if seq.handle.cancelled:  # gone before it started: drop it quietly
                    self._pop(waiting)
                    seq.abandon()
                    continue
                if seq.expired(time.monotonic()) is ErrorKind.DEADLINE:  # waited past its deadline
                    self._pop(waiting)
                    seq.fail(ErrorKind.DEADLINE, "the call's deadline passed while it waited for a slot")
                    continue
                if not fits(seq):
                    break
                self._pop(waiting)
                if not seq.preemptions:  # a preempted (or parked) request coming back was charged when first admitted
                    start = max(lane.tag, self._vtime)
                    self._vtime = start
                    lane.tag = start + cost_of(seq) / lane.policy.weight
                lane.running[seq.request.priority] += 1
                self._active += 1
                taken.append(seq)
            return taken

    def _pop(self, waiting: collections.deque[Generation]) -> None:
        waiting.popleft()
        self._queued -= 1

    def victim(self) -> tuple[str, Priority] | None:
        """When every slot is taken: whose running request should give its slot to the request
        that goes next, as ``(tenant, least urgent priority it may take)``; None: nobody's.

        - Priority: a waiting HIGH request takes the slot of a running LOW one (any tenant's).
        - Fair share: the next request's tenant runs fewer than its weighted share of the
          slots (among the tenants with work), and another tenant runs more than its own:
          that tenant gives up a slot, of a request no more urgent than the waiting one.

        The preempted request goes back to the front of its tenant's queue
        (``requeue``); one that is the next by fair share never preempts, so slots do not
        change hands back and forth.
        """
        with self._cond:
            picked = self._next()
            if picked is None:
                return None
            lane, waiting = picked
            donor = self._donor(lane, Priority(lane.waiting.index(waiting)))
            return None if donor is None else (donor[0].policy.name, donor[1])

    def requeue(self, seq: Generation) -> None:
        """``seq`` (taken earlier) was preempted: back to the front of its tenant's queue. Its
        tenant keeps the charge of its first admission, and is not charged again when it
        comes back: a refund now would move the tenant's tag back ahead of the request that
        preempted it, and hand the slot straight back (tested)."""
        with self._cond:
            request = seq.request
            lane = self._lane(request.tenant)
            lane.running[request.priority] -= 1
            self._active -= 1
            lane.waiting[request.priority].appendleft(seq)
            self._queued += 1
            self._cond.notify()

    def wait_for_arrival(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a request to be waiting; True when one is."""
        with self._cond:
            if not self._queued and not self._closed:
                self._cond.wait(timeout=timeout_s)
            return self._queued > 0

    def vacate(self, *seqs: Generation) -> None:
        """``seqs`` (taken earlier) left their slots: what they did not generate goes back to their tenants."""
        with self._cond:
            for seq in seqs:
                lane = self._lane(seq.request.tenant)
                lane.running[seq.request.priority] -= 1
                self._active -= 1
                self._refund(lane, seq)
            self._cond.notify()

    def _refund(self, lane: _Lane, seq: Generation) -> None:
        unused = seq.request.max_new_tokens - len(seq.generated)
        if unused > 0:
            lane.tag -= unused / lane.policy.weight

    # -- parked streams (flow control) ---------------------------------------------------

    def behind(self, seq: Generation) -> bool:
        """Whether ``seq``'s reader has left ``stream_backlog`` events unread: time to park it."""
        reader = seq.reader
        return reader is not None and not seq.finished and reader.unread() >= self._limits.stream_backlog

    def park(self, seq: Generation, now: float | None = None) -> None:
        """``seq`` (taken earlier, its slot and blocks given back) waits for its reader: it holds no
        slot and no queue place until the reader is down to ``resume_backlog`` unread events
        (``unpark``, called from the reader's side), then goes to the front of its tenant's queue
        as a preempted request does, and is not charged again.

        Why a parked stream counts nowhere: the slot and the blocks are what other callers
        wait for, and a place in the queue would refuse them (RESOURCE_EXHAUSTED, or a first
        token estimated too late for their deadline) for a stream that cannot use either. What
        it does hold is bounded: its unread events, at most ``stream_backlog`` (+1), and at most
        ``max_parked`` parked streams (past that the one idle longest ends STALLED_READER).
        Coming back, it may take the queue past ``max_queue`` by itself, as a preempted
        request does; it was admitted once, and is never refused."""
        now = time.monotonic() if now is None else now
        reader = seq.reader
        assert reader is not None, "only a stream with a reader falls behind"
        request = seq.request
        with self._cond:
            lane = self._lane(request.tenant)
            lane.running[request.priority] -= 1
            self._active -= 1
            self._parked[seq] = now
            if len(self._parked) > self._limits.max_parked:
                oldest = min(self._parked, key=self._idle_since)
                self._end_parked(
                    oldest,
                    f"the caller stopped reading this stream ({self._unread(oldest)} chunks unread), and more streams "
                    f"wait for their callers than the server keeps ({self._limits.max_parked}); read a stream as it "
                    "comes, or resume it from the tokens received (GenerateRequest.resume)",
                )
            self._cond.notify()
        reader.wake_when_read(self._limits.resume_backlog, lambda: self.unpark(seq))

    def unpark(self, seq: Generation) -> None:
        """``seq``'s reader caught up (or left): back to the front of its tenant's queue (or, when
        cancelled, dropped quietly: nobody listens). Called from any thread; a no-op unless parked."""
        with self._cond:
            if self._parked.pop(seq, None) is None:
                return
            request = seq.request
            lane = self._lane(request.tenant)
            if seq.handle.cancelled:
                self._refund(lane, seq)
                seq.abandon()
                return
            lane.waiting[request.priority].appendleft(seq)
            self._queued += 1
            self._cond.notify()

    def expire_parked(self, now: float | None = None) -> None:
        """End the parked streams whose readers have read nothing for ``stalled_reader_timeout_s``
        (called by the engine between steps; cheap when nothing is due)."""
        now = time.monotonic() if now is None else now
        if not self._parked or now < self._next_sweep:
            return
        with self._cond:
            self._expire_parked(now)

    def _expire_parked(self, now: float) -> None:
        timeout = self._limits.stalled_reader_timeout_s
        if timeout <= 0 or not self._parked or now < self._next_sweep:
            return
        self._next_sweep = now + min(self.SWEEP_INTERVAL_S, timeout / 4)
        for seq in [seq for seq in self._parked if now - self._idle_since(seq) >= timeout]:
            self._end_parked(
                seq,
                f"the caller stopped reading this stream: {self._unread(seq)} chunks stayed unread for {timeout:g} s "
                "(--stalled-reader-timeout) and the server stopped generating for it; read a stream as it comes, "
                "or resume it from the tokens received (GenerateRequest.resume)",
            )

    def _idle_since(self, seq: Generation) -> float:
        """Since when a parked stream's reader has read nothing: its last read, or the park."""
        reader = seq.reader
        parked_at = self._parked[seq]
        return parked_at if reader is None else max(parked_at, reader.last_read())

    @staticmethod
    def _unread(seq: Generation) -> int:
        return seq.reader.unread() if seq.reader is not None else 0

    def _end_parked(self, seq: Generation, message: str) -> None:
        del self._parked[seq]
        self._refund(self._lane(seq.request.tenant), seq)
        if seq.handle.cancelled:
            seq.abandon()
            return
        seq.fail(ErrorKind.STALLED_READER, message)
        self._on_stalled(seq)

    def drain_waiting(self) -> list[Generation]:
        """Every waiting and parked request, taken out (the engine stops: it ends them)."""
        with self._cond:
            waiting = [seq for lane in self._lanes.values() for q in lane.waiting for seq in q]
            for lane in self._lanes.values():
                for q in lane.waiting:
                    q.clear()
            self._queued = 0
            waiting += self._parked
            self._parked.clear()
            return waiting

    def close(self, refusal: EngineClosed | None = None) -> None:
        """Admit nothing more; ``refusal`` is what ``put`` raises from now on."""
        with self._cond:
            self._closed = True
            if refusal is not None:
                self._refusal = refusal
            self._cond.notify_all()

    def by_tenant(self) -> list[TenantLoad]:
        """Active and queued requests per tenant and priority (the metrics' per-tenant gauges)."""
        with self._cond:
            return [
                TenantLoad(name, p.label, lane.running[p], len(lane.waiting[p]))
                for name, lane in self._lanes.items()
                for p in Priority
            ]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active(self) -> int:
        return self._active

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def parked(self) -> int:
        return len(self._parked)
