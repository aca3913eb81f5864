"""Queries of what a running job produces: metrics, samples, checkpoints."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Checkpoint, JobMetric, JobSample


def metric_rows(
    session: Session, job_id: str, *, step_from: int | None, step_to: int | None
) -> list[JobMetric]:
    query = select(JobMetric).where(JobMetric.job_id == job_id)
    if step_from is not None:
        query = query.where(JobMetric.step >= step_from)
    if step_to is not None:
        query = query.where(JobMetric.step <= step_to)
    return list(session.scalars(query.order_by(JobMetric.step)))


def metrics_after(session: Session, job_id: str, after_step: int, limit: int) -> list[JobMetric]:
    query = (
        select(JobMetric)
        .where(JobMetric.job_id == job_id, JobMetric.step > after_step)
        .order_by(JobMetric.step)
        .limit(limit)
    )
    return list(session.scalars(query))


def samples_page(
    session: Session, job_id: str, *, after_step: int | None, step: int | None, limit: int
) -> tuple[list[JobSample], bool]:
    query = select(JobSample).where(JobSample.job_id == job_id)
    if step is not None:
        query = query.where(JobSample.step == step)
    if after_step is not None:
        query = query.where(JobSample.step > after_step)
    rows = list(session.scalars(query.order_by(JobSample.step).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        )
    )
