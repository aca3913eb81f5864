"""Metric series: the rollups written beside each step's row, and the reads built on them.

A job's per-step metrics live in `job_metrics` (one JSON object per step). Reading a long job
from there costs a scan of every row (100,000 steps took 7-10 s and gigabytes as ORM rows), so
each inserted step also feeds `job_metric_rollups`: for every metric name and every level L of
ROLLUP_LEVELS, the count, sum, min, max and last step of the finite values in the aligned block
of steps ((k - 1) * L, k * L]. Aggregates only add, so the order steps arrive in does not
matter. A read covers its step range with the largest blocks that fit (plus at most a few
single steps at each edge, read from `job_metrics`) and lets the database group them into
windows: it touches O(max_points) rows per metric whatever the job's length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    Select,
    and_,
    case,
    cast,
    func,
    literal,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.core.models import JobMetric, JobMetricRollup

ROLLUP_LEVELS = (4, 16, 64, 256, 1024, 4096, 16384)
# The pseudo-name whose rollup counts metric rows (steps), whatever values a row holds. No
# real metric can use it: names are kept in rollups only when 1..MAX_NAME_CHARS long.
STEPS = ""
MAX_NAME_CHARS = 200
_BATCH = 1000  # rows per INSERT when many steps are written at once

R = JobMetricRollup
Key = tuple[int, str, int]  # (level, name, block)


@dataclass(frozen=True)
class Window:
    """A metric's finite values in one window of steps (for STEPS: the steps recorded)."""

    count: int
    total: float
    min: float | None
    max: float | None
    last_step: int | None


# --- writes ---------------------------------------------------------------------------------


def finite(value: Any) -> float | None:
    """The value as a float if it is a finite number (JSON has no NaN; bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _merge(acc: dict[Any, list[Any]], key: Any, part: Sequence[Any]) -> None:
    """Fold one aggregate [count, total, min, max, last_step] into acc[key]."""
    have = acc.get(key)
    if have is None:
        acc[key] = list(part)
        return
    have[0] += part[0]
    have[1] += part[1]
    for i, pick in ((2, min), (3, max), (4, max)):
        if part[i] is not None:
            have[i] = part[i] if have[i] is None else pick(have[i], part[i])


def rollups_of(points: Iterable[tuple[int, dict[str, Any]]]) -> dict[Key, list[Any]]:
    """Aggregates of (step, values) points at every level: the smallest level from the points,
    each larger one from the level below (a block of L steps is four blocks of L / 4)."""
    base = ROLLUP_LEVELS[0]
    level_acc: dict[tuple[str, int], list[Any]] = {}
    for step, values in points:
        block = -(-step // base)
        _merge(level_acc, (STEPS, block), (1, 0.0, None, None, step))
        for name, raw in values.items():
            if not 1 <= len(name) <= MAX_NAME_CHARS:
                continue
            v = finite(raw)
            _merge(
                level_acc,
                (name, block),
                (0, 0.0, None, None, None) if v is None else (1, v, v, v, step),
            )
    out: dict[Key, list[Any]] = {(base, n, b): part for (n, b), part in level_acc.items()}
    below = base
    for level in ROLLUP_LEVELS[1:]:
        upper: dict[tuple[str, int], list[Any]] = {}
        for (name, block), agg in level_acc.items():
            _merge(upper, (name, -(-block * below // level)), agg)  # ceil(block * below / level)
        out.update({(level, n, b): agg for (n, b), agg in upper.items()})
        level_acc, below = upper, level
    return out


def _pick(dialect: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Null-ignoring two-argument least/greatest: Postgres has them; SQLite's scalar min/max
    return null when either side is null, so fall back to the other side."""
    if dialect == "postgresql":
        return func.least, func.greatest
    return (
        lambda a, b: func.coalesce(func.min(a, b), a, b),
        lambda a, b: func.coalesce(func.max(a, b), a, b),
    )


def add_rollups(session: Session, *, job_id: str, acc: dict[Key, list[Any]]) -> None:
    """Upsert aggregates: add counts and sums, keep the smaller min and the larger max."""
    if not acc:
        return
    dialect = session.get_bind().dialect.name
    least, greatest = _pick(dialect)
    rows = [
        {
            "job_id": job_id,
            "level": level,
            "name": name,
            "block": block,
            "count": part[0],
            "total": part[1],
            "min": part[2],
            "max": part[3],
            "last_step": part[4],
        }
        for (level, name, block), part in acc.items()
    ]
    # Core insert of the table, not of the ORM class: the ORM's bulk path would send one
    # statement per row with an upsert. (Sending the columns as arrays through unnest, one
    # statement, measured no faster: the time is the database's, 7 ms for 182 rows.)
    ins: Any = (postgresql if dialect == "postgresql" else sqlite).insert(R.__table__)
    ex = ins.excluded
    stmt = ins.on_conflict_do_update(
        index_elements=[R.job_id, R.level, R.name, R.block],
        set_={
            "count": R.count + ex["count"],
            "total": R.total + ex.total,
            "min": least(R.min, ex["min"]),
            "max": greatest(R.max, ex["max"]),
            "last_step": greatest(R.last_step, ex.last_step),
        },
    )
    for start in range(0, len(rows), _BATCH):
        session.execute(stmt, rows[start : start + _BATCH])


def add_many(
    session: Session,
    *,
    job_id: str,
    attempt: int,
    points: Sequence[tuple[int, dict[str, float | None]]],
    now: datetime,
) -> int:
    """Insert many steps at once (imports, tests, benchmarks), each at most once like
    `progress.add_metrics_once`; the rollups count only the steps actually inserted. Returns
    how many were."""
    dialect = session.get_bind().dialect.name
    ins: Any = (postgresql if dialect == "postgresql" else sqlite).insert(JobMetric.__table__)
    stmt = ins.on_conflict_do_nothing().returning(JobMetric.step)
    by_step = dict(points)
    inserted: list[int] = []
    for start in range(0, len(points), _BATCH):
        rows = [
            {"job_id": job_id, "step": s, "attempt": attempt, "values": v, "created_at": now}
            for s, v in points[start : start + _BATCH]
        ]
        inserted += session.scalars(stmt, rows).all()
    add_rollups(session, job_id=job_id, acc=rollups_of((s, by_step[s]) for s in inserted))
    return len(inserted)


# --- reads ----------------------------------------------------------------------------------


def step_span(
    session: Session, *, job_id: str, step_from: int | None, step_to: int | None
) -> tuple[int, int] | None:
    """First and last recorded step within the bounds (two index probes), or None."""
    query = select(func.min(JobMetric.step), func.max(JobMetric.step)).where(
        JobMetric.job_id == job_id
    )
    if step_from is not None:
        query = query.where(JobMetric.step >= step_from)
    if step_to is not None:
        query = query.where(JobMetric.step <= step_to)
    first, last = session.execute(query).one()
    return None if first is None else (int(first), int(last))


def names(session: Session, *, job_id: str) -> list[str]:
    """Every metric name the job has recorded, from the top level's few rows."""
    query = (
        select(R.name)
        .where(R.job_id == job_id, R.level == ROLLUP_LEVELS[-1], R.name != STEPS)
        .distinct()
        .order_by(R.name)
    )
    return list(session.scalars(query))


def raw_page(
    session: Session, *, job_id: str, step_from: int, step_to: int, limit: int
) -> list[tuple[int, dict[str, Any]]]:
    """Up to `limit` + 1 (step, values) rows from `step_from`, in step order (plain rows, not
    ORM objects: the caller only reads them)."""
    query = (
        select(JobMetric.step, JobMetric.values)
        .where(JobMetric.job_id == job_id, JobMetric.step.between(step_from, step_to))
        .order_by(JobMetric.step)
        .limit(limit + 1)
    )
    return [(int(step), values) for step, values in session.execute(query)]


def _raw_points(
    dialect: str, job_id: str, wanted: Sequence[str], ranges: Sequence[tuple[int, int]]
) -> list[Select[Any]]:
    """Single steps as one-point aggregates, from the JSON rows: one row per wanted name that
    the step has, plus one under STEPS per step. Only JSON numbers count as values."""
    in_ranges = or_(*(JobMetric.step.between(lo, hi) for lo, hi in ranges))
    mine = and_(JobMetric.job_id == job_id, in_ranges)
    steps = select(
        literal(STEPS).label("name"),
        JobMetric.step.label("end"),
        literal(1).label("count"),
        literal(0.0).label("total"),
        cast(null(), Float).label("min"),
        cast(null(), Float).label("max"),
        JobMetric.step.label("last_step"),
    ).where(mine)
    if not wanted:
        return [steps]
    if dialect == "postgresql":
        each = func.json_each(JobMetric.values).table_valued("key", "value").alias("e")
        is_number: ColumnElement[bool] = func.json_typeof(each.c.value) == "number"
        number = cast(cast(each.c.value, postgresql.TEXT), Float)
    else:
        each = func.json_each(JobMetric.values).table_valued("key", "value", "type").alias("e")
        is_number = each.c.type.in_(("integer", "real"))
        number = cast(each.c.value, Float)
    value = case((is_number, number))
    values = (
        select(
            each.c.key.label("name"),
            JobMetric.step.label("end"),
            case((is_number, 1), else_=0).label("count"),
            case((is_number, number), else_=0.0).label("total"),
            value.label("min"),
            value.label("max"),
            case((is_number, JobMetric.step)).label("last_step"),
        )
        .select_from(JobMetric)
        .join(each, true())
        .where(mine, each.c.key.in_(wanted))
    )
    return [steps, values]


def windows(
    session: Session,
    *,
    job_id: str,
    wanted: Sequence[str],
    runs: Sequence[tuple[int, int, int]],
    raw: Sequence[tuple[int, int]],
    width: int | None,
) -> dict[str, list[Window]]:
    """One query: the rollup blocks of `runs` ((level, first block, last block)) and the
    single steps of `raw` ((first step, last step)), grouped into windows of `width` steps
    ((k - 1) * width < step <= k * width; None: one window). Every block must lie inside one
    window. Returns {name: windows in step order} for the wanted names and STEPS; a window
    with no finite value is left out, so a name has at most one row per window."""
    names_and_steps = [*wanted, STEPS]
    parts: list[Select[Any]] = []
    if runs:
        in_runs = or_(*(and_(R.level == lv, R.block.between(lo, hi)) for lv, lo, hi in runs))
        parts.append(
            select(
                R.name,
                (R.block * R.level).label("end"),
                R.count,
                R.total,
                R.min,
                R.max,
                R.last_step,
            ).where(R.job_id == job_id, R.name.in_(names_and_steps), in_runs)
        )
    if raw:
        parts += _raw_points(session.get_bind().dialect.name, job_id, wanted, raw)
    if not parts:
        return {}
    u = union_all(*parts).subquery("u")
    keys: list[ColumnElement[Any]] = [u.c.name]
    if width is not None:
        keys.append((cast(u.c.end, Integer) + (width - 1)) // width)  # ceil(end / width)
    query = (
        select(
            u.c.name,
            func.sum(u.c.count),
            func.sum(u.c.total),
            func.min(u.c.min),
            func.max(u.c.max),
            func.max(u.c.last_step),
        )
        .group_by(*keys)
        .having(func.sum(u.c.count) > 0)
        .order_by(*keys)
    )
    out: dict[str, list[Window]] = {}
    for name, count, total, low, high, last in session.execute(query):
        out.setdefault(name, []).append(Window(int(count), float(total), low, high, last))
    return out


def totals(session: Session, *, job_ids: Sequence[str], name: str) -> dict[str, float]:
    """The sum of metric `name` over all steps of each job (jobs that never recorded it are
    left out), from the top level's few rollup rows per job."""
    if not job_ids:
        return {}
    query = (
        select(R.job_id, func.sum(R.total))
        .where(R.job_id.in_(job_ids), R.level == ROLLUP_LEVELS[-1], R.name == name)
        .group_by(R.job_id)
    )
    return {job_id: float(total) for job_id, total in session.execute(query)}
