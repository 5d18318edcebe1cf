"""Summaries the benches share: median and range (min-max) of a list of measurements."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of `values` (all positive measurements).

    Raises:
        ValueError: `values` is empty.
    """
    if not values:
        raise ValueError("no measurements to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def ratio(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Ratio of medians, and the range of that ratio from the two ranges (min/max, max/min)."""
    a, b = summary(num), summary(den)
    return {"median": a["median"] / b["median"], "min": a["min"] / b["max"],
            "max": a["max"] / b["min"]}


def fmt(s: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    """`median [min-max]` with `digits` decimals after multiplying by `scale`."""
    return (f"{s['median'] * scale:.{digits}f} "
            f"[{s['min'] * scale:.{digits}f}-{s['max'] * scale:.{digits}f}]")


def error_bars(stats: Mapping[str, dict[str, float]], names: Sequence[str], scale: float = 1.0
               ) -> tuple[list[float], list[list[float]]]:
    """The medians of `stats[name]` for `names` and matplotlib's `yerr` reaching each one's
    min and max, all times `scale`."""
    medians = [stats[n]["median"] * scale for n in names]
    return medians, [[m - stats[n]["min"] * scale for n, m in zip(names, medians, strict=True)],
                     [stats[n]["max"] * scale - m for n, m in zip(names, medians, strict=True)]]
