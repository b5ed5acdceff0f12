"""The statistics every benchmark reports, with one definition of a percentile:
``tokenwire.bench.percentile`` (linear interpolation between the two nearest ranks, numpy's
default), which ``tokenwire bench`` and ``run_bench``'s reports use too."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tokenwire.bench import percentile

__all__ = ["cell", "median", "ms", "p99", "percentile", "ratios", "spread"]

median = statistics.median


def p99(values: Sequence[float]) -> float:
    """The 99th percentile of values that are there (a ValueError for none)."""
    if (value := percentile(values, 99)) is None:
        raise ValueError("p99 of no values")
    return value


def ms(seconds: Sequence[float], q: float, digits: int | None = None) -> float | None:
    """The q-th percentile of ``seconds``, in milliseconds (rounded to ``digits``, where given); None for none."""
    value = percentile(seconds, q)
    return None if value is None else value * 1000 if digits is None else round(value * 1000, digits)


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``a / b`` for each repeat: a ratio taken inside a repeat, where the machine's noise cancels."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def spread(values: Sequence[float], digits: int = 1) -> str:
    """``median (min–max)``: how the repeats of a figure are reported."""
    if not values:
        return "-"
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def cell(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """A table cell: ``value * scale`` to ``digits`` places; "-" where it was not measured."""
    return "-" if value is None else f"{value * scale:.{digits}f}"
