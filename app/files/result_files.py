"""A job's result file: its per-step metrics as CSV, the `result_files` of the OpenAI view.

The file is not stored: its id names the job (`file_results_<job hex>`), and its content is read
from the job's metric rows when asked for, page by page, so it is always as complete as the job
and costs nothing to keep. It lives in the job's project and goes when the job goes.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.models import File, Job
from app.jobs import repository as jobs_repo
from app.progress import metrics_repository as metrics_repo
from jobspec import MAX_STEPS

PREFIX = "file_results_"
PURPOSE = "fine-tune-results"
# Metric rows read per query while writing the CSV.
PAGE_ROWS = 2000


def file_id_of(job_id: str) -> str:
    return PREFIX + job_id.removeprefix("job_")


def job_id_of(file_id: str) -> str | None:
    """The job a result file id names, or None for any other id."""
    if not file_id.startswith(PREFIX):
        return None
    return "job_" + file_id.removeprefix(PREFIX)


def csv_chunks(session: Session, *, job_id: str) -> Iterator[bytes]:
    """The CSV: a `step` column, then one column per metric name the job recorded (sorted); a
    step without a metric leaves its cell empty."""
    names = metrics_repo.names(session, job_id=job_id)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["step", *names])
    step_from = 0
    while True:
        page = metrics_repo.raw_page(
            session, job_id=job_id, step_from=step_from, step_to=MAX_STEPS, limit=PAGE_ROWS
        )
        for step, values in page[:PAGE_ROWS]:
            writer.writerow([step, *(_cell(values.get(name)) for name in names)])
        yield buffer.getvalue().encode()
        buffer.seek(0)
        buffer.truncate()
        if len(page) <= PAGE_ROWS:
            return
        step_from = page[PAGE_ROWS][0]


def _cell(value: object) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def virtual_file(session: Session, *, project_id: str, file_id: str) -> File | None:
    """The result file `file_id` names as a File (not stored; `bytes` is the CSV's size, read
    through), or None when it names no job of the project."""
    job_id = job_id_of(file_id)
    if job_id is None:
        return None
    job = jobs_repo.get_for_project(session, project_id=project_id, job_id=job_id)
    if job is None:
        return None
    size = sum(len(chunk) for chunk in csv_chunks(session, job_id=job.id))
    return File(
        id=file_id,
        project_id=project_id,
        filename=f"{job.id}_metrics.csv",
        purpose=PURPOSE,
        bytes=size,
        row_count=job.current_step,
        rows=[],
        created_at=_created(job),
    )


def _created(job: Job) -> datetime:
    return as_utc(job.finished_at) or as_utc(job.created_at) or utcnow()
