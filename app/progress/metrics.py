"""Metric series for charts and CI: pick names and a step range, then either

* downsample (`max_points` given): at most `max_points` points per series, each the count, mean,
  min and max of one window of `width` steps ((k - 1) * width < step <= k * width) and the
  window's last step with a value, so a spike never disappears from a zoomed-out chart; or
* read raw points (no `max_points`): one point per step, a page of at most `limit` steps at a
  time, with the step to continue from.

Either read costs O(points returned), not O(steps recorded): windows are built in the database
from the rollups of app.progress.metrics_repository (a window is a whole number of rollup blocks, which
is why `width` is a multiple of a rollup level rather than exactly steps / max_points).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.core.errors import InvalidRequest
from app.progress import metrics_repository as metrics_repo
from app.progress.metrics_repository import MAX_NAME_CHARS, ROLLUP_LEVELS, STEPS
from jobspec import text_problem

Point = dict[str, Any]
Run = tuple[int, int, int]  # (level, first block, last block)


@dataclass(frozen=True)
class Plan:
    """How to read steps first..last as at most max_points windows."""

    width: int | None  # steps per window; None: one window for the whole range
    runs: list[Run]  # rollup blocks that tile the range, each inside one window
    raw: list[tuple[int, int]]  # step ranges too short for any block, read row by row


@dataclass(frozen=True)
class Series:
    steps: int  # steps recorded in the requested range
    available: list[str]
    series: dict[str, list[Point]]
    bucket_steps: int  # steps per window; 1 for raw points
    next_step_from: int | None  # raw reads: where the next page starts; None: no more


def _windows_spanned(first: int, last: int, width: int) -> int:
    return -(-last // width) - -(-first // width) + 1


def plan(first: int, last: int, max_points: int) -> Plan:
    """Windows as wide as needed for at most `max_points` over first..last (first >= 0), as a
    multiple of the largest rollup level that fits, so they tile into that level's blocks."""
    span = last - first + 1
    needed = -(-span // max_points)
    level = max((lv for lv in ROLLUP_LEVELS if lv <= needed), default=1)
    width = level * -(-needed // level)
    if max_points > 1 and _windows_spanned(first, last, width) > max_points:
        # Windows are aligned to multiples of width, so the range can straddle one more than
        # span / width; width >= (last - first) / (max_points - 1) always fits.
        width = max(width + level, level * -(-(last - first) // ((max_points - 1) * level)))
    runs: list[Run] = []
    raw: list[tuple[int, int]] = []
    levels = [lv for lv in reversed(ROLLUP_LEVELS) if lv <= level]
    _cover(first, last, levels, runs, raw)
    return Plan(None if max_points == 1 else width, runs, raw)


def _cover(
    lo: int, hi: int, levels: list[int], runs: list[Run], raw: list[tuple[int, int]]
) -> None:
    """Tile lo..hi with the largest aligned blocks first: a run of level-L blocks in the
    middle, the two leftover edges with smaller levels, single steps below the smallest."""
    if lo > hi:
        return
    if not levels:
        raw.append((lo, hi))
        return
    level, smaller = levels[0], levels[1:]
    first_block = -(-(lo - 1) // level) + 1  # the first block starting at or after lo
    last_block = hi // level  # the last block ending at or before hi
    if first_block > last_block:
        _cover(lo, hi, smaller, runs, raw)
        return
    runs.append((level, first_block, last_block))
    _cover(lo, (first_block - 1) * level, smaller, runs, raw)
    _cover(last_block * level + 1, hi, smaller, runs, raw)


def _check_names(names: list[str] | None) -> list[str] | None:
    if names is None:
        return None
    for name in names:
        problem = text_problem(name)
        if problem is None and not 1 <= len(name) <= MAX_NAME_CHARS:
            problem = f"must be 1 to {MAX_NAME_CHARS} characters"
        if problem is not None:
            raise InvalidRequest(f"metric name {problem}", param="names")
    return list(dict.fromkeys(names))  # once each, in the order asked


def read(
    session: Session,
    *,
    job_id: str,
    names: list[str] | None,
    step_from: int | None,
    step_to: int | None,
    max_points: int | None,
    limit: int,
) -> Series:
    """The series of `names` (default: every name recorded) over step_from..step_to."""
    wanted = _check_names(names)
    available = metrics_repo.names(session, job_id=job_id)
    wanted = available if wanted is None else wanted
    span = metrics_repo.step_span(session, job_id=job_id, step_from=step_from, step_to=step_to)
    if span is None:
        return Series(0, available, {n: [] for n in wanted}, 1, None)
    first, last = span
    if max_points is None:
        return _raw(session, job_id, wanted, available, first, last, limit)
    p = plan(first, last, max_points)
    found = metrics_repo.windows(
        session, job_id=job_id, wanted=wanted, runs=p.runs, raw=p.raw, width=p.width
    )
    series = {
        name: [
            {
                "step": w.last_step,
                "value": w.total / w.count,
                "min": w.min,
                "max": w.max,
                "count": w.count,
            }
            for w in found.get(name, [])
        ]
        for name in wanted
    }
    steps = sum(w.count for w in found.get(STEPS, []))
    width = p.width if p.width is not None else last - first + 1
    return Series(steps, available, series, width, None)


def _raw(
    session: Session,
    job_id: str,
    wanted: list[str],
    available: list[str],
    first: int,
    last: int,
    limit: int,
) -> Series:
    rows = metrics_repo.raw_page(session, job_id=job_id, step_from=first, step_to=last, limit=limit)
    next_step_from = rows[limit][0] if len(rows) > limit else None
    series: dict[str, list[Point]] = {name: [] for name in wanted}
    for step, values in rows[:limit]:
        for name, points in series.items():
            v = metrics_repo.finite(values.get(name))
            if v is not None:
                points.append({"step": step, "value": v, "min": v, "max": v, "count": 1})
    # How many steps the whole range holds: a one-window read of the step counts only.
    p = plan(first, last, 1)
    counts = metrics_repo.windows(
        session, job_id=job_id, wanted=[], runs=p.runs, raw=p.raw, width=None
    )
    steps = sum(w.count for w in counts.get(STEPS, []))
    return Series(steps, available, series, 1, next_step_from)
