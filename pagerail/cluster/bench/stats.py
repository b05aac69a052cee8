"""Latency summaries (mean and percentiles) and plain-text result tables."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90 and p99 of `values`; all zero when there are none, so tables keep their shape."""
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned columns; floats get two decimals unless already formatted."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells)
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
