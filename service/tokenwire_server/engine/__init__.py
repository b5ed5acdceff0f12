"""Engines: plain requests in, token events out. Nothing here knows protobuf or gRPC."""

from __future__ import annotations

from ..model import LoadedModel
from .base import Engine, EngineLimits, EngineStats
from .types import (
    EngineClosed,
    EngineOverloaded,
    ErrorEvent,
    ErrorKind,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    RequestHandle,
    SamplingOptions,
    TextEvent,
    TokenInfo,
    Usage,
)

ENGINES = ("batched", "simple")


def create_engine(name: str, loaded: LoadedModel, limits: EngineLimits, workers: int) -> Engine:
    if name == "batched":
        from .batched import BatchedEngine

        return BatchedEngine(loaded, limits)
    if name == "simple":
        from .simple import SimpleEngine

        return SimpleEngine(loaded, limits, workers)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}")


__all__ = [
    "ENGINES",
    "Engine",
    "EngineClosed",
    "EngineLimits",
    "EngineOverloaded",
    "EngineStats",
    "ErrorEvent",
    "ErrorKind",
    "Event",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "RequestHandle",
    "SamplingOptions",
    "TextEvent",
    "TokenInfo",
    "Usage",
    "create_engine",
]
