"""Small statistics helpers: repeated measurements and their spread."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

MB = 1_000_000  # throughput figures are in MB/s (10^6 bytes)
GB = 1_000_000_000


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repeated measurements, and the spread in % of the median."""
    if not values:
        raise ValueError("summary() of no values")
    med = statistics.median(values)
    low, high = min(values), max(values)
    spread = (high - low) / med * 100 if med else 0.0
    return {
        "median": med,
        "min": low,
        "max": high,
        "spread_pct": spread,
        "n": len(values),
        "values": list(values),
    }


def percentile(values: Sequence[float], pct: float) -> float:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile() of no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Paired ratios, repetition by repetition (same rep = same machine conditions)."""
    if len(numerators) != len(denominators):
        raise ValueError("paired ratios need as many numerators as denominators")
    return [n / d if d else float("inf") for n, d in zip(numerators, denominators, strict=True)]


def row(
    variant: str,
    metric: str,
    unit: str,
    values: Sequence[float],
    *,
    ratio_label: str | None = None,
    ratio_values: Sequence[float] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One line of a scenario's table (and of the JSON)."""
    out: dict[str, Any] = {
        "variant": variant,
        "metric": metric,
        "unit": unit,
        "summary": summary(values),
        "note": note,
    }
    if ratio_label is not None and ratio_values is not None:
        out["ratio"] = {"label": ratio_label, "summary": summary(ratio_values)}
    return out


def compared_rows(
    metric: str,
    unit: str,
    values: Mapping[str, Sequence[float]],
    notes: Mapping[str, str],
    *,
    default_note: str = "",
    reference: str = "tierckpt",
) -> list[dict[str, Any]]:
    """One row per variant, in `values`' order; each variant but `reference`
    also gets the paired ratio `reference / this`."""
    rows = []
    for name, mine in values.items():
        note = notes.get(name, default_note)
        if name == reference:
            rows.append(row(name, metric, unit, mine, note=note))
            continue
        rows.append(
            row(
                name,
                metric,
                unit,
                mine,
                ratio_label=f"{reference} / this",
                ratio_values=ratios(values[reference], mine),
                note=note,
            )
        )
    return rows
