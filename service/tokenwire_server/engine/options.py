"""What the batched engine is asked to do, and what every ``auto`` comes to, decided once.

``EngineOptions`` holds the flags as given (``--forward``, ``--kernels``, ``--attention``, ``--step-graphs``,
``--compile-step``, ``--overlap``, ``--prefix-cache``, ``--kv-resident-tokens``,
``--torch-threads``) and whether the engine may drop the model's plain weights. ``resolve``
reads them against the loaded model and its device and returns ``Resolved``: the forward
pass, the step graphs, the overlap and the block order, each with the reason where ``auto``
chose against it, and the thread counts a CPU step may run on. The engine builds what
``Resolved`` says and logs it in one start-up line; nothing below it decides an ``auto`` again.

One rule is left where its answer is known: whether the compiled CPU ops run (``--kernels
auto``) depends on building and loading them, which ``native.NativeForward`` does.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..checkpoint import PlainLlama
from . import ATTENTION_CHOICES, FORWARDS, KERNEL_CHOICES, OVERLAP_MODES
from .graphs import resolve_mode
from .native import unsupported_reason
from .threads import choices_for

if TYPE_CHECKING:
    import torch

    from ..model import LoadedModel

# ``--forward auto``: the engine's own pass (``native.NativeForward``) where the model is
# Llama-shaped and runs on a CPU, else transformers' forward; ``native`` insists; ``transformers``
# always takes the model's own forward (one prefill pass, then one decode pass).


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The batched engine's options as requested (``auto`` not yet decided)."""

    forward: str = "auto"
    kernels: str = "auto"
    # How the native pass's attention reads the paged KV: ``auto`` the compiled CPU op where the
    # compiled ops run, else SDPA over gathered blocks; ``flex`` FlexAttention over the pool in place.
    attention: str = "auto"
    prefix_cache: bool = True
    kv_resident_tokens: int = 0  # blocks touched before idle cached ones are reused (0: by device)
    step_graphs: str = "auto"
    step_graphs_context: int = 4096  # CUDA graphs captured at start up to this context (0: none)
    compile_step: bool = False
    overlap: str = "auto"
    # Threads a CPU step computes on (``--torch-threads``): 0 lets ``threads.ThreadLayout`` choose
    # between torch's count and one fewer by measurement; N pins N.
    threads: int = 0
    # The engine may drop the model's plain weights where it keeps its own (packed) copy;
    # the model's own ``forward`` cannot run afterwards.
    own_weights: bool = False

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("forward", self.forward, FORWARDS),
            ("kernels", self.kernels, KERNEL_CHOICES),
            ("attention", self.attention, ATTENTION_CHOICES),
            ("overlap", self.overlap, OVERLAP_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Every ``auto`` decided for one model on one device, with the reasons."""

    options: EngineOptions
    native: bool  # the engine's own pass; else transformers' forward
    why_not_native: str | None
    step_graphs: str  # off, static or cuda
    why_no_step_graphs: str | None
    overlap: bool  # deliver step N while step N+1 runs
    why_overlap: str
    # KV tokens' worth of blocks the pool touches before it reuses idle cached ones (None: all).
    resident_kv_tokens: int | None
    why_resident_kv: str
    # Whether the native pass packs its weights for oneDNN: a compiled step takes plain
    # weights (oneDNN's packed GEMM has no fake kernel for torch.compile to trace).
    pack_weights: bool
    # The thread counts a step may run on (the first: where it starts), and why.
    threads: tuple[int, ...] = (1,)
    why_threads: str = ""

    @property
    def forward(self) -> str:
        return "native" if self.native else "transformers"

    def log_fields(self) -> dict[str, Any]:
        """The decisions, for the engine's start-up line."""
        return {
            "forward": self.forward,
            "why_not_native": self.why_not_native,
            "step_graphs": self.step_graphs,
            "why_no_step_graphs": self.why_no_step_graphs,
            "overlap": self.overlap,
            "why_overlap": self.why_overlap,
            "prefix_cache": self.options.prefix_cache,
            "resident_kv_tokens": self.resident_kv_tokens,
            "why_resident_kv": self.why_resident_kv,
        }


def resolve(options: EngineOptions, loaded: LoadedModel) -> Resolved:
    """What ``options`` come to for ``loaded`` on its device; a ValueError for what cannot
    run there (``--forward native`` on a model it cannot take, ``--step-graphs cuda`` off
    CUDA, ...), which start-up reports as a usage error."""
    device: torch.device = loaded.device
    reason = unsupported_reason(loaded.model)
    if options.forward == "native" and reason is not None:
        raise ValueError(f"--forward native cannot run this model: {reason}")
    if options.forward == "auto" and reason is None and device.type != "cpu":
        # Measured and tested on a CPU only; on a GPU ``auto`` keeps transformers'
        # forward until the native pass has been run there (``--forward native`` opts in).
        reason = f"auto takes the native pass on a CPU only (device {device.type})"
    if options.forward == "transformers":
        reason = "--forward transformers"
    native = reason is None
    if options.attention == "flex" and not native:
        raise ValueError(
            f"--attention flex is the native pass's, which does not run here ({reason}): add --forward native"
        )
    if not native and isinstance(loaded.model, PlainLlama):
        # load_model(native_only=True) reads it so only where the native pass runs it.
        raise ValueError(f"{reason}: this checkpoint was read for the native pass alone (it has no forward)")
    graphs, why_no_graphs = resolve_mode(options.step_graphs, native, device, options.compile_step)
    if options.attention == "flex" and options.step_graphs == "auto" and graphs != "off":
        # The fixed-shape step a graph holds gathers its rows for SDPA; flex would then run
        # only in steps with a prompt chunk. ``--step-graphs cuda`` asks for that mix.
        graphs, why_no_graphs = "off", "--attention flex: the graphed decode step attends through SDPA"
    if options.overlap == "auto":
        # On a CPU the host computes the step itself: there is nothing to overlap with.
        overlap = device.type == "cuda"
        why_overlap = f"auto: {'on' if overlap else 'off'} on {device.type}"
    else:
        overlap, why_overlap = options.overlap == "on", f"--overlap {options.overlap}"
    resident, why_resident = resident_kv(options.kv_resident_tokens, device)
    import torch

    threads, why_threads = choices_for(options.threads, torch.get_num_threads(), device.type)
    if len(threads) > 1 and not native:
        # Only the native pass is built (and checked, ``results_depend_on_threads``) so that a
        # row's numbers do not depend on the thread count.
        threads, why_threads = threads[:1], f"transformers' forward: {threads[0]} threads"
    return Resolved(
        options=options,
        native=native,
        why_not_native=reason,
        step_graphs=graphs,
        why_no_step_graphs=why_no_graphs,
        overlap=overlap,
        why_overlap=why_overlap,
        resident_kv_tokens=resident,
        why_resident_kv=why_resident,
        pack_weights=not options.compile_step,
        threads=threads,
        why_threads=why_threads,
    )


# ``--kv-resident-tokens 0`` on a CPU: an untouched KV block is memory not yet resident, so the
# pool reuses idle cached blocks once this many tokens' worth are touched (377 MiB of fp32 KV on
# the default model), rather than from the first request on or only at the whole budget.
RESIDENT_KV_TOKENS_CPU = 8192


def resident_kv(requested: int, device: torch.device) -> tuple[int | None, str]:
    """``--kv-resident-tokens`` on ``device`` (None: the whole pool), and why."""
    if requested > 0:
        return requested, "--kv-resident-tokens"
    if device.type == "cpu":
        return RESIDENT_KV_TOKENS_CPU, f"auto: {RESIDENT_KV_TOKENS_CPU} on cpu (untouched KV is not resident)"
    return None, f"auto: the whole pool on {device.type} (committed at start)"


# ``--max-prefill-tokens 0``: a CPU computes each prompt token itself, so a small chunk keeps
# the other streams' pace (docs/benchmarks.md, the prompt budget); a GPU reads a 512-token
# chunk in about the time of a decode step, and a smaller one only lengthens time to first token.
PREFILL_TOKENS = {"cpu": 20, "cuda": 512}


def prefill_budget(requested: int, device: torch.device) -> tuple[int, str]:
    """``--max-prefill-tokens`` on ``device``, and why: as given, or (0) the device's."""
    if requested > 0:
        return requested, "--max-prefill-tokens"
    kind = "cpu" if device.type == "cpu" else "cuda"
    return PREFILL_TOKENS[kind], f"auto: {PREFILL_TOKENS[kind]} on {device.type}"
