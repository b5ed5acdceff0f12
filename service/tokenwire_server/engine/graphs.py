"""The compiled decode step: a step of one-token rows padded to a bucket, replayed as a CUDA graph.

On a GPU a decode step of a small model is a few hundred short kernels; launched one by
one from Python, the host is the bottleneck and the device idles between them. A CUDA
graph records the step's kernels once and launches them all in one call. A graph holds
fixed shapes and fixed addresses, so:

- A step's rows are padded to a *batch bucket* (``BATCH_BUCKETS``: 1, 2, 4, ... up to the
  first at or past ``--max-active``), and its block tables to a *width bucket* (a power
  of two of blocks, up to a row's most). Each (rows, width) key gets its own graph,
  captured the first time a step needs it (``captures``), and its own input buffers.
- The inputs (ids, positions, write places, lengths, tables) of a step travel in one
  int64 buffer: filled on the host (pinned memory on CUDA), one ``non_blocking`` copy to
  the device, views of it are the graph's inputs. The host waits once per step, for the
  sampled ids (the sampler, outside the graph, on the device).
- Padding rows read and write only the scratch block (``kv.PagedCache``), at column 0;
  their logits are dropped.
- Prompt chunks, and a step that mixes them with decode rows, run the native pass
  eagerly (``native.NativeForward.__call__``), as do more rows than the largest bucket.

``static`` replays the same fixed-shape step eagerly, without a graph, on any device: what
the CPU tests check (padding, buckets, masks, the inputs' layout) is exactly what a CUDA
graph captures. ``--compile-step on`` wraps the step in ``torch.compile`` first (inductor: Triton
on CUDA, C++ on a CPU), one compiled graph per bucket (``dynamic=False``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..transfer import pinned
from . import STEP_GRAPH_MODES
from .blocks import blocks_for

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# ``auto``: CUDA graphs where the native pass runs on CUDA, else none; ``cuda``: insist;
# ``static``: the fixed-shape step without a graph (any device); ``off``: the eager step.
MODES = STEP_GRAPH_MODES
WARMUP_RUNS = 2  # eager runs on a side stream before a capture (allocator, cuBLAS workspaces, lazy inits)
_INPUTS = 5  # ids, positions, write blocks, write offsets, lengths: [rows] each, then the tables


def batch_buckets(max_rows: int, buckets: Sequence[int] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The batch buckets for up to ``max_rows`` rows: the buckets below it and the first at or
    past it; past the largest, ``max_rows`` itself is the last."""
    out = [b for b in buckets if b < max_rows]
    out.append(next((b for b in buckets if b >= max_rows), max_rows))
    return tuple(out)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``rows`` rows, or None (more than the largest)."""
    return next((b for b in buckets if b >= rows), None)


def width_for(blocks: int, max_width: int) -> int:
    """The width bucket for tables of up to ``blocks`` blocks: the next power of two, at most ``max_width``."""
    width = 1
    while width < blocks:
        width *= 2
    return max(1, min(width, max_width))


@dataclasses.dataclass
class _Entry:
    """One (rows, width) key: its input buffers, its graph (None: replayed eagerly) and output."""

    rows: int
    width: int
    host: torch.Tensor  # [rows * (5 + width)] int64; pinned on CUDA
    device: torch.Tensor  # the same on the device; the step's inputs are views of it
    graph: Any = None
    out: torch.Tensor | None = None

    def views(self) -> tuple[torch.Tensor, ...]:
        rows = self.rows
        ids, positions, blocks, offsets, lengths = (self.device[i * rows : (i + 1) * rows] for i in range(_INPUTS))
        tables = self.device[_INPUTS * rows :].view(rows, self.width)
        return ids, positions, blocks, offsets, tables, lengths


class DecodeGraphs:
    """Decode steps of one-token rows run through fixed-shape buckets (see the module's doc).

    ``step(ids, positions, blocks, offsets, tables, lengths) -> [rows, vocab]`` is the
    native pass's ``decode_step``; ``capture`` records a CUDA graph per key (else each step
    calls ``step`` on the key's buffers)."""

    def __init__(
        self,
        step: Callable[..., torch.Tensor],
        device: torch.device,
        block_size: int,
        scratch: int,
        max_rows: int,
        max_width: int,
        pad_id: int,
        capture: bool,
        compile_step: bool = False,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device (here {device.type})")
        self.device = device
        self.block_size, self.scratch, self.pad_id = block_size, scratch, pad_id
        self.buckets = batch_buckets(max_rows)
        self.max_width = max(1, max_width)
        self.capture = capture
        self.step: Callable[..., torch.Tensor] = (
            torch.compile(step, dynamic=False, fullgraph=True) if compile_step else step
        )
        self.compiled = compile_step
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._keys: set[tuple[int, int]] = set()
        self._pool: Any = None  # one memory pool for every graph: steps never run two at once
        self.replays = 0  # steps run through a bucket
        # Keys whose set-up ran out of device memory: their steps run eagerly, never set up again.
        self.refused: set[tuple[int, int]] = set()

    def prepare(self, context_tokens: int) -> int:
        """Set up (capture, on CUDA) every batch bucket at every table width up to
        ``context_tokens`` of context, now rather than in the first step that needs each; return
        how many keys were set up. A wider table later is set up when first needed."""
        if context_tokens <= 0:
            return 0
        started = time.monotonic()
        widest = width_for(blocks_for(context_tokens, self.block_size), self.max_width)
        widths = [width_for(1, self.max_width)]
        while widths[-1] < widest:  # the widths width_for hands out: powers of two, capped at max_width
            widths.append(width_for(widths[-1] * 2, self.max_width))
        before = self.captures
        for rows in self.buckets:
            for width in widths:
                if (rows, width) not in self._entries and (rows, width) not in self.refused:
                    self._try_set_up(rows, width)
        log.info(
            "decode step buckets prepared",
            extra={
                "keys": self.captures - before,
                "context_tokens": context_tokens,
                "widest_blocks": widest,
                "mode": self.mode,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return self.captures - before

    def release(self) -> None:
        """Drop every key's buffers and graph, and the graphs' memory pool (an engine that stopped)."""
        self._entries.clear()
        self._pool = None

    @property
    def mode(self) -> str:
        return "cuda" if self.capture else "static"

    def run(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Logits ``[len(ids), vocab]`` for one-token rows (``ids[i]`` at column
        ``positions[i]`` of table ``tables[i]``), or None when they fit no bucket (the
        caller runs the eager step). The tensor is the graph's output buffer: read it
        before the next step."""
        rows = len(ids)
        bucket = bucket_for(rows, self.buckets)
        if bucket is None or rows == 0:
            return None
        needed = max(blocks_for(position + 1, self.block_size) for position in positions)
        if needed > self.max_width:
            return None
        key = (bucket, width_for(needed, self.max_width))
        entry = self._entries.get(key) or (None if key in self.refused else self._try_set_up(*key))
        if entry is None:
            return None
        self._stage(entry, ids, positions, tables)
        entry.device.copy_(entry.host, non_blocking=True)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:
            out = self.step(*entry.views())
        self.replays += 1
        assert out is not None
        return out[:rows]

    def _stage(
        self, entry: _Entry, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> None:
        """Write a step's inputs into the key's host buffer; rows past ``len(ids)`` are padding."""
        rows, width, block_size = entry.rows, entry.width, self.block_size
        arr = entry.host.numpy()
        self._pad(arr, rows)
        count = len(ids)
        arr[:count] = ids
        arr[rows : rows + count] = positions
        arr[2 * rows : 2 * rows + count] = [table[p // block_size] for table, p in zip(tables, positions, strict=True)]
        arr[3 * rows : 3 * rows + count] = [p % block_size for p in positions]
        arr[4 * rows : 4 * rows + count] = [p + 1 for p in positions]
        base = _INPUTS * rows
        for row, table in enumerate(tables):
            used = min(len(table), width)
            arr[base + row * width : base + row * width + used] = table[:used]

    def _pad(self, arr: Any, rows: int) -> None:
        """Every row padding: the pad id at column 0 of the scratch block, length 1, tables all scratch."""
        arr[:rows] = self.pad_id
        arr[rows : 2 * rows] = 0
        arr[2 * rows : 3 * rows] = self.scratch
        arr[3 * rows : 4 * rows] = 0
        arr[4 * rows : 5 * rows] = 1
        arr[_INPUTS * rows :] = self.scratch

    def _try_set_up(self, rows: int, width: int) -> _Entry | None:
        """``_set_up``, or None where it runs out of device memory: the key is refused from then
        on, so its steps run eagerly (the caller's fallback) rather than failing their rows one
        by one (the engine's out-of-memory policy) while each retry captures the same key again."""
        try:
            return self._set_up(rows, width)
        except torch.OutOfMemoryError as exc:
            self.refused.add((rows, width))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning(
                "decode step bucket not set up: out of device memory; its steps run eagerly",
                extra={"rows": rows, "width_blocks": width, "mode": self.mode, "error": str(exc).splitlines()[0]},
            )
            return None

    def buffers(self, rows: int, width: int) -> _Entry:
        """A key's input buffers, every row padding; not kept (``memory.measure_worst_step`` runs
        the widest key on them before the KV pool is sized)."""
        size = rows * (_INPUTS + width)
        host = torch.empty(size, dtype=torch.long, pin_memory=pinned(self.device))
        entry = _Entry(rows, width, host, torch.empty(size, dtype=torch.long, device=self.device))
        self._pad(host.numpy(), rows)
        entry.device.copy_(host)
        return entry

    def resize(self, scratch: int, max_width: int) -> None:
        """After the KV pool is sized (``memory``): its scratch block, and the widest table it can hold."""
        self.release()
        self.scratch, self.max_width = scratch, max(1, max_width)

    def _set_up(self, rows: int, width: int) -> _Entry:
        started = time.monotonic()
        entry = self.buffers(rows, width)
        if self.capture:
            self.record(entry)
        elif self.compiled:
            self.step(*entry.views())  # compile now, on padding: the first real step is not the one that waits
        self._entries[(rows, width)] = entry
        self._keys.add((rows, width))
        elapsed = time.monotonic() - started
        log.info(
            "decode step bucket ready",
            extra={
                "rows": rows,
                "width_blocks": width,
                "mode": self.mode,
                "compiled": self.compiled,
                "seconds": round(elapsed, 3),
            },
        )
        return entry

    def record(self, entry: _Entry) -> None:  # pragma: no cover - needs a CUDA device (make test-gpu)
        """Warm up on a side stream, then record the step on padding inputs (they touch only the scratch block)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.step(*entry.views())
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.out = self.step(*entry.views())
        if self._pool is None:
            self._pool = graph.pool()
        entry.graph = graph

    @property
    def captures(self) -> int:
        """Keys set up (a graph captured, or buffers made for ``static``), released ones included."""
        return len(self._keys)

    def keys(self) -> list[tuple[int, int]]:
        """Every (bucket, width) set up, released ones included."""
        return sorted(self._keys)


def resolve_mode(mode: str, native: bool, device: torch.device, compile_step: bool = False) -> tuple[str, str | None]:
    """What ``--step-graphs mode`` comes to: ``off``, ``static`` or ``cuda``, and why when it
    gives no graphs. ``cuda`` and ``static`` need the native pass; ``cuda`` a CUDA device.
    ``--compile-step on`` needs a fixed-shape step: under ``auto`` off CUDA, ``static``."""
    if mode not in MODES:
        raise ValueError(f"unknown step graphs {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "off":
        if compile_step:
            raise ValueError("--compile-step on compiles the fixed-shape step: not with --step-graphs off")
        return "off", "--step-graphs off"
    if not native:
        if mode == "auto" and not compile_step:
            return "off", "the decode step is graphed on the native pass only"
        flag = f"--step-graphs {mode}" if mode != "auto" else "--compile-step on"
        raise ValueError(f"{flag} needs the native pass (--forward native)")
    if mode == "auto":
        if device.type == "cuda":
            return "cuda", None
        return ("static", None) if compile_step else ("off", f"CUDA graphs need a CUDA device (here {device.type})")
    if mode == "cuda" and device.type != "cuda":
        raise ValueError(f"--step-graphs cuda needs a CUDA device (here {device.type})")
    return mode, None
