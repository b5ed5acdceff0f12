"""How many threads compute a CPU step: all of torch's, or one fewer, chosen by measurement.

A step on a CPU is ~150 parallel regions (every GEMM, and the decode attention). Between two
of them libgomp's idle threads spin for ``GOMP_SPINCOUNT`` iterations (``--omp-spin-count``),
then sleep, and waking a sleeping thread costs tens of microseconds, more in a VM. So:

- on a quiet host the threads must spin across the gaps between a step's regions: with a spin
  of 1,000 the second of two threads added almost nothing on a 2-core Intel host (a c=1 step
  of the default model 30 ms at 2 threads spinning 1,000, 32 ms at 1 thread, 19 ms at 2
  threads spinning 10,000: docs/architecture.md, "A CPU step's threads");
- beside a busy neighbour a thread that spins while its partner waits for a core holds every
  region's barrier: at 2 threads spinning 10,000 the same step took 71 ms, where 1 thread
  kept its 32 ms.

No fixed layout is best on both, and a host moves between them (a neighbour starts, a CPU
quota throttles). ``ThreadLayout`` measures instead. It runs decode steps on the current
choice and, now and then, a few on the other, compares their times at the same number of rows,
and keeps whichever was faster:

- the first probe comes early (``FIRST_PROBE_AFTER``: in the server's warm-up); a probe that keeps
  the current choice doubles the wait for the next (``SHORTEST_WAIT`` decode steps up to
  ``LONGEST_WAIT``);
- on all of torch's threads, once ``SETTLED_AFTER`` probes in a row have kept them, no more
  periodic probes: a probe's steps on fewer threads are the slowest a quiet host has, and
  enough of them would set a stream's p99 inter-token gap (measured: c=1 p99 ÷ p50 1.69 in a run
  of 128 tokens holding a probe, 1.12-1.20 without). One probe settles it where it was
  decisive, its steps ``DECISIVE`` × the current choice's or slower (a quiet 2-core host: ~1.6×):
  a second would only repeat it, with 4 more of the first stream's slowest steps;
- the current choice's steps turning slower (each of its last 3 ``SLOWER`` × the best it has
  made at that row count and about as many attended columns, a mark kept through idle spells: a
  neighbour has started) calls a probe at once, if they are slower than the other choice could
  be: more than ``MARGIN`` × the other's pace at the last probe at that row count (as a ratio to
  the current choice's). A shared host has slow spells that slow every count alike (measured on
  a 2-core Intel host at c=1: runs of 7-20 steps at ~1.7× with the count pinned, where one
  thread is ~1.8× slower than two); a probe there cannot win, and its 4 steps on fewer threads
  were the slowest of the stream (c=1 p99 ÷ p50 1.8, against 1.5 with the count pinned). The
  columns are part of the mark because a step's attention grows with its rows' contexts: a
  stream of 1,000 tokens ends with steps ~1.4× its first ones on a 2-core host, which against a
  mark per row count alone called a probe (4 steps on fewer threads, the slowest of the stream)
  in every long stream;
- a change of choice starts the waits again from the shortest; on fewer threads the periodic
  probes go on, since nothing else would notice the neighbour leaving.

``--torch-threads N`` pins the count and turns this off.

It is only sound where a row's numbers do not depend on the thread count, or a stream would
change its tokens when the layout changes: the compiled ops and the attention split their
work over rows, never inside one row's sums, and ``results_depend_on_threads`` checks the
GEMMs (oneDNN's split of the reduction is its own choice) once at start. ``ThreadLayout`` is
torch-free (the engine passes the function that sets the count); only that check imports torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

# Decode steps before the first probe: few, so that the server's warm-up (``WARM_UP_DECODE_STEPS``)
# holds it, and its steps on fewer threads, the slowest a quiet host has, fall on no caller's
# stream (at decode step 16 they were 4 of the first stream's tokens, and set the p99 gap of a
# fresh server's short runs).
FIRST_PROBE_AFTER = 3
# The wait after the first probe and after a change of choice; each probe that keeps the choice
# doubles it, up to the longest.
SHORTEST_WAIT = 16
LONGEST_WAIT = 800
# Probes in a row that kept all of torch's threads, after which only a slow-down calls one.
SETTLED_AFTER = 2
# A probe whose steps ran this much slower (median ÷ median) than the current choice's counts
# for all of them: the answer is clear, not noise.
DECISIVE = 1.25
# Steps run on the other choice per probe, the first of them not measured (the threads that
# were asleep wake, oneDNN may build a primitive for the new count): as after any change.
PROBE_STEPS = 4
# The decode steps a warm-up generation needs for the first probe to end within it: the current
# choice's first steps (the first of them not measured), then the probe's.
WARM_UP_DECODE_STEPS = FIRST_PROBE_AFTER + PROBE_STEPS
# Steps kept per (threads, rows); samples older than this many decode steps are not compared.
KEEP = 9
STALE_AFTER = 64
NEVER = float("inf")
# The other choice must be this much faster (median ÷ median) to take over.
MARGIN = 1.05
# Each of the current choice's last 3 steps this much slower than its best at that row count: probe now.
SLOWER = 1.3
# Attended columns per mark: a step's columns are compared with steps within 2^(1/4) (19 %) of
# them, so a step whose time is all attention grows less than SLOWER within one.
COLUMN_STEPS_PER_DOUBLING = 4


def column_band(columns: int | None) -> int | None:
    """The band of attended ``columns`` whose steps share a slow-down mark (None: not given)."""
    if columns is None or columns < 1:
        return None
    return int(math.log2(columns) * COLUMN_STEPS_PER_DOUBLING)


class ThreadLayout:
    """Chooses the thread count of each step among ``choices`` (the first is where it starts).

    ``pick(rows)`` before a step says how many threads to run it on (``rows``: the step's
    decode rows for a decode-only step, None for a step that reads prompt tokens, which runs on
    the current choice and is not measured); ``record(rows, threads, seconds)`` after it.
    ``apply(threads)`` is called whenever the count a step needs differs from the last one set.
    """

    def __init__(
        self,
        choices: Sequence[int],
        apply: Callable[[int], None],
        *,
        first_probe_after: int = FIRST_PROBE_AFTER,
        longest_wait: int = LONGEST_WAIT,
        probe_steps: int = PROBE_STEPS,
        on_change: Callable[[int, int, dict[str, Any]], None] | None = None,
    ) -> None:
        if not choices or any(count < 1 for count in choices):
            raise ValueError(f"thread choices must be positive counts, got {list(choices)}")
        self.choices = tuple(dict.fromkeys(choices))
        self.current = self.choices[0]
        self._apply = apply
        self._set: int | None = None
        self._first_wait = SHORTEST_WAIT
        self._longest_wait = longest_wait
        self._wait = SHORTEST_WAIT
        self._probe_steps = probe_steps
        self._on_change = on_change
        self._next_probe: float = first_probe_after
        self._decodes = 0  # decode steps seen
        self._probing: int | None = None  # the choice being probed
        self._probe_left = 0
        self._probe_rows: int | None = None
        self._kept_full = 0  # probes in a row that kept the first choice
        self._fresh = True  # the next step is the first since the count changed: not counted
        # (decode step, seconds, column band) per (threads, rows)
        self._times: dict[tuple[int, int], deque[tuple[int, float, int | None]]] = {}
        # the current choice's mark per (rows, column band) (``_turned_slower``)
        self._best: dict[tuple[int, int | None], float] = {}
        # per rows: the other choice's median step ÷ the current's at the last probe that kept it
        self._other_pace: dict[int, float] = {}
        self.probes = 0
        self.switches = 0

    @property
    def adaptive(self) -> bool:
        return len(self.choices) > 1

    def pick(self, rows: int | None) -> int:
        """The thread count for the next step, applied."""
        threads = self.current
        if self.adaptive and rows is not None:
            if self._probing is None and self._decodes >= self._next_probe:
                self._probing = next(count for count in self.choices if count != self.current)
                self._probe_left = self._probe_steps
                self._probe_rows = rows
                self.probes += 1
            if self._probing is not None:
                threads = self._probing
        if threads != self._set:
            self._apply(threads)
            self._fresh = self._set is not None
            self._set = threads
        return threads

    def record(self, rows: int | None, threads: int, seconds: float, columns: int | None = None) -> None:
        """A step's time on ``threads`` (``columns``: the columns its rows attended over, all
        together); ends a probe when it has its steps, and decides."""
        if not self.adaptive or rows is None:
            return
        self._decodes += 1
        counted, self._fresh = not self._fresh, False
        band = column_band(columns)
        if counted:
            self._times.setdefault((threads, rows), deque(maxlen=KEEP)).append((self._decodes, seconds, band))
        if self._probing is None:
            if counted and threads == self.current and self._turned_slower(rows, band):
                self._next_probe = self._decodes  # the host changed: probe at the next step
            return
        if threads != self._probing:
            return
        self._probe_left -= 1
        if self._probe_left > 0:
            return
        probed, self._probing = self._probing, None
        assert self._probe_rows is not None
        medians = self._medians(probed, self._probe_rows)
        faster = self._compare(medians, self._probe_rows)
        before = self._kept(self.current, self._probe_rows)[-3:]
        self._times.clear()  # what comes next is measured afresh
        if faster is None:
            self._wait = min(2 * self._wait, self._longest_wait)
            if self.current != self.choices[0]:
                self._kept_full = 0
            else:
                decisive = medians is not None and medians[1] >= DECISIVE * medians[0]
                self._kept_full = SETTLED_AFTER if decisive else self._kept_full + 1
            # The other choice is no cure for a slower step here: its pace now is the mark. The
            # marks of this row count's other bands were set before the host changed: dropped,
            # they are set afresh as steps reach them (kept, each band would call its own probe).
            self._best = {key: mark for key, mark in self._best.items() if key[0] != self._probe_rows}
            if medians is not None:
                self._other_pace[self._probe_rows] = medians[1] / medians[0]
            for band in {band for _, _, band in before}:
                self._best[(self._probe_rows, band)] = statistics.median([s for _, s, b in before if b == band])
        else:
            previous, self.current = self.current, probed
            self.switches += 1
            self._wait = self._first_wait
            self._kept_full = 0
            self._best.clear()
            self._other_pace.clear()
            if self._on_change is not None:
                self._on_change(previous, probed, faster)
        settled = self.current == self.choices[0] and self._kept_full >= SETTLED_AFTER
        self._next_probe = NEVER if settled else self._decodes + self._wait

    def _turned_slower(self, rows: int, band: int | None) -> bool:
        """Whether the current choice's last 3 steps at ``rows`` and column ``band`` were each
        ``SLOWER`` × its mark there (the best median of 3 it has made there, kept through idle
        spells and other row counts: a neighbour that starts while the server waits is seen at
        the next steps), and slower than ``MARGIN`` × the other choice's pace at its last probe
        at ``rows`` (the same mark times that probe's ratio): steps the other choice could not
        beat call no probe."""
        last = self._kept(self.current, rows)[-3:]
        if len(last) < 3 or any(b != band for _, _, b in last):
            return False  # 3 steps of this band in a row, or nothing to say
        recent = [seconds for _, seconds, _ in last]
        best = self._best.get((rows, band))
        factor = max(SLOWER, MARGIN * self._other_pace.get(rows, 0.0))
        if best is not None and min(recent) > factor * best:  # all 3: one slow step is noise
            return True
        self._best[(rows, band)] = min(best if best is not None else float("inf"), statistics.median(recent))
        return False

    def _kept(self, threads: int, rows: int) -> list[tuple[int, float, int | None]]:
        """The steps kept at (``threads``, ``rows``) that are not stale."""
        kept = self._times.get((threads, rows), ())
        return [entry for entry in kept if self._decodes - entry[0] <= STALE_AFTER]

    def _recent(self, threads: int, rows: int) -> list[float]:
        return [seconds for _, seconds, _ in self._kept(threads, rows)]

    def _medians(self, probed: int, rows: int) -> tuple[float, float] | None:
        """The current choice's and ``probed``'s median step at ``rows`` (None: not comparable,
        the rows changed meanwhile: the next probe will tell)."""
        # The current choice's last steps before the probe, not its whole window: after a slow-down
        # (the trigger) the window still holds the faster steps from before it.
        mine, theirs = self._recent(self.current, rows)[-3:], self._recent(probed, rows)
        if len(mine) < 2 or len(theirs) < 2:
            return None
        return statistics.median(mine), statistics.median(theirs)

    @staticmethod
    def _compare(medians: tuple[float, float] | None, rows: int) -> dict[str, Any] | None:
        """The figures when the probed choice (``_medians``) beat the current one by ``MARGIN``, else None."""
        if medians is None or medians[1] * MARGIN >= medians[0]:
            return None
        now, probe = medians
        return {"rows": rows, "step_ms_before": round(now * 1e3, 2), "step_ms_after": round(probe * 1e3, 2)}


def choices_for(requested: int, available: int, device_type: str) -> tuple[tuple[int, ...], str]:
    """The thread counts a CPU step may run on, and why: ``--torch-threads N`` pins N; 0 lets
    the layout choose between torch's count and one fewer (a neighbour most often takes a
    core); a GPU or a single thread leaves nothing to choose."""
    if requested > 0:
        return (requested,), f"--torch-threads {requested}"
    if device_type != "cpu":
        return (available,), f"the step runs on {device_type}"
    if available < 2:
        return (available,), "one thread"
    return (available, available - 1), f"auto: {available} or {available - 1}, by measured step time"


def results_depend_on_threads(
    layers: Sequence[Any], counts: Sequence[int], rows: Sequence[int] = (1, 2, 5)
) -> str | None:
    """Whether any of ``layers`` (callables ``[rows, in] -> [rows, out]``, with ``in_features``)
    gives other numbers at another of ``counts`` threads (None: the same bits at every count)."""
    import torch

    before = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for layer in layers:
                for count in rows:
                    x = torch.randn(count, layer.in_features, generator=generator)
                    outputs = []
                    for threads in counts:
                        torch.set_num_threads(threads)
                        outputs.append(layer(x))
                    if any(not torch.equal(outputs[0], other) for other in outputs[1:]):
                        return f"a {count}-row GEMM [{layer.in_features} in] gives other bits at {list(counts)} threads"
    finally:
        torch.set_num_threads(before)
    return None
