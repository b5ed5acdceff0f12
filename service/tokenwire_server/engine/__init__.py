"""Engines: plain requests in, token events out. Nothing here knows protobuf or gRPC.

``batched`` (continuous batching in one loop) and ``simple`` (one ``generate()``
per request) run the model with torch; ``backend.LocalBackend`` puts either
behind the backend seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..domain import EngineObserver
    from ..model import LoadedModel
    from .base import Engine, EngineLimits

ENGINES = ("batched", "simple")


def create_engine(
    name: str,
    loaded: LoadedModel,
    limits: EngineLimits,
    workers: int,
    observer: EngineObserver | None = None,
    forward: str = "auto",
    own_weights: bool = False,
    kernels: str = "auto",
    prefix_cache: bool = True,
    step_graphs: str = "auto",
    compile_step: bool = False,
    overlap: str = "auto",
) -> Engine:
    """``own_weights``: the engine may drop the model's plain weights where it keeps its
    own (packed) copy; the model's own ``forward`` cannot run afterwards."""
    if name == "batched":
        from .batched import BatchedEngine

        return BatchedEngine(
            loaded, limits, observer, forward=forward, own_weights=own_weights, kernels=kernels, prefix_cache=prefix_cache,
            step_graphs=step_graphs, compile_step=compile_step, overlap=overlap,
        )  # fmt: skip
    if name == "simple":
        from .simple import SimpleEngine

        return SimpleEngine(loaded, limits, workers, observer)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")
