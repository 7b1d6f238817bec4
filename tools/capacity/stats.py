"""Small statistics shared by the benchmarks and the fleet simulator."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
