"""The statistics every benchmark reports, with one definition of a percentile.

A percentile is ``tokenwire.bench.percentile``: linear interpolation between the two
nearest ranks of the sorted values (numpy's default, "linear"), so p99 of 20 values lies
between the 19th and the 20th. It lives in the client because ``tokenwire bench`` and
``run_bench``'s reports use it too; every figure in docs/benchmarks.md goes through it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from tokenwire.bench import percentile

__all__ = ["median", "ms", "p99", "percentile", "spread"]

median = statistics.median


def p99(values: Sequence[float]) -> float:
    """The 99th percentile of values that are there (a ValueError for none)."""
    value = percentile(values, 99)
    if value is None:
        raise ValueError("p99 of no values")
    return value


def ms(seconds: Sequence[float], q: float) -> float | None:
    """The q-th percentile of ``seconds``, in milliseconds; None for none."""
    value = percentile(seconds, q)
    return None if value is None else value * 1000


def spread(values: Sequence[float], digits: int = 1) -> str:
    """``median (min–max)``: how the repeats of a figure are reported."""
    if not values:
        return "-"
    lo, mid, hi = min(values), median(values), max(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"
