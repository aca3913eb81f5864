"""Metric series for charts: pick names and a step range, then downsample to at most
`max_points` buckets of consecutive steps, keeping min, max and mean of each bucket so a spike
never disappears from a zoomed-out chart."""

from __future__ import annotations

import math
from typing import Any

from app.models import JobMetric


def series(
    rows: list[JobMetric], names: list[str] | None, max_points: int | None
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Return ({name: [points]}, every name seen). A point is
    {"step", "value", "min", "max", "count"}; `step` is the bucket's last step, `value` its mean."""
    available = sorted({name for row in rows for name in row.values})
    wanted = names or available
    out: dict[str, list[dict[str, Any]]] = {}
    for name in wanted:
        points = [
            (row.step, float(v))
            for row in rows
            if (v := row.values.get(name)) is not None and math.isfinite(float(v))
        ]
        out[name] = _downsample(points, max_points)
    return out, available


def _downsample(points: list[tuple[int, float]], max_points: int | None) -> list[dict[str, Any]]:
    if not points:
        return []
    size = 1 if not max_points else math.ceil(len(points) / max_points)
    buckets = [points[i : i + size] for i in range(0, len(points), size)]
    return [
        {
            "step": bucket[-1][0],
            "value": sum(v for _, v in bucket) / len(bucket),
            "min": min(v for _, v in bucket),
            "max": max(v for _, v in bucket),
            "count": len(bucket),
        }
        for bucket in buckets
    ]
