"""Checkpoint lookups for admission (a job may start from one of its own project's checkpoints).

The writes and the per-job listing live in `app.repositories.progress`; this module only answers
"does this project's job have a checkpoint at this step", scoped to the project in one query so
another project's job and a missing one look the same."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Checkpoint, Job


def checkpoint_of_project_job(
    session: Session, *, project_id: str, job_id: str, step: int
) -> Checkpoint | None:
    """The checkpoint of `job_id` at `step`, when that job belongs to `project_id`; else None."""
    return session.scalars(
        select(Checkpoint)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(Checkpoint.job_id == job_id, Checkpoint.step == step, Job.project_id == project_id)
    ).one_or_none()
