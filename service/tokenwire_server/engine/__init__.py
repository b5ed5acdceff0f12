"""Engines: plain requests in, token events out. Nothing here knows protobuf or gRPC.

``batched`` (continuous batching in one loop) and ``simple`` (one ``generate()``
per request) run the model with torch; ``backend.LocalBackend`` puts either
behind the backend seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..domain import EngineObserver
    from ..model import LoadedModel
    from .base import Engine, EngineLimits
    from .options import EngineOptions

ENGINES = ("batched", "simple")

# The batched engine's option values, here (no torch) so that the configuration offers the
# same choices the engine checks: ``--forward``, ``--kernels``, ``--attention``, ``--step-graphs``,
# ``--overlap``.
FORWARDS = ("auto", "native", "transformers")
KERNEL_CHOICES = ("auto", "compiled", "torch")
ATTENTION_CHOICES = ("auto", "sdpa", "flex")
STEP_GRAPH_MODES = ("auto", "off", "static", "cuda")
OVERLAP_MODES = ("auto", "on", "off")


def create_engine(
    name: str,
    loaded: LoadedModel,
    limits: EngineLimits,
    workers: int = 1,
    observer: EngineObserver | None = None,
    options: EngineOptions | None = None,
    **requested: Any,
) -> Engine:
    """The engine ``name`` over ``loaded``. The batched engine's options come as an
    ``EngineOptions`` or as its fields (``kernels="torch"``, ``overlap="on"``, ...): they
    are decided once, against the model and its device, by ``options.resolve``. ``workers``
    is the simple engine's thread count."""
    if options is not None and requested:
        raise TypeError("give the batched engine's options as an EngineOptions or as its fields, not both")
    if name == "batched":
        from .batched import BatchedEngine
        from .options import EngineOptions

        return BatchedEngine(loaded, limits, observer, options or EngineOptions(**requested))
    if name == "simple":
        from .simple import SimpleEngine

        return SimpleEngine(loaded, limits, workers, observer)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
