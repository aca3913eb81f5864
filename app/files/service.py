"""The project's files: uploaded datasets (create, with rows read by app.datasets.upload_rows;
get, list, delete) and a job's result file (app.files.result_files), and what
``GET /v1/files/{id}/content`` sends for either. A new job's large inline rows are spilled into
a file by app.datasets.service."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.core.capacity import held_slot
from app.core.clock import utcnow
from app.core.errors import FileInUse, InvalidRequest, NotFound
from app.core.ids import new_id
from app.core.models import File
from app.datasets import repository as files_repo
from app.datasets.upload_rows import parse_rows
from app.files import result_files
from app.jobs import repository as jobs_repo
from app.jobs import transitions
from grading.fair_slots import FairSlots
from jobspec import text_problem


def create_file(
    session: Session,
    *,
    project_id: str,
    filename: str,
    purpose: str,
    body: BinaryIO,
    uploads: FairSlots,
) -> File:
    """Validate every line, then store the rows (flushed; the request commits). The body is
    read and decoded in one of the process's upload slots (``uploads``): each decode may take
    the row budget, so the slots bound the process (429 or 503 with Retry-After when full)."""
    problem = text_problem(filename)
    if problem is not None:  # stored as text: Postgres refuses NUL
        raise InvalidRequest(f"file name {problem}", param="file")
    with held_slot(uploads, project_id, param="file"):
        content = body.read()
        rows = parse_rows(content, filename)
    row = File(
        id=new_id("file"),
        project_id=project_id,
        filename=filename[:255] or "upload.jsonl",
        purpose=purpose,
        bytes=len(content),
        row_count=len(rows),
        rows=rows,
        created_at=utcnow(),
    )
    return files_repo.add(session, file=row)


def get_file(session: Session, *, project_id: str, file_id: str) -> File:
    """The project's file (an upload, or a job's result file), or NotFound naming `file_id`."""
    row = files_repo.get_for_project(
        session, project_id=project_id, file_id=file_id
    ) or result_files.virtual_file(session, project_id=project_id, file_id=file_id)
    if row is None:
        raise NotFound(f"file {file_id} not found", param="file_id")
    return row


def list_files(
    session: Session,
    *,
    project_id: str,
    after: str | None,
    limit: int,
    newest_first: bool,
    purpose: str | None,
) -> tuple[list[File], bool]:
    """A page of the project's uploads (result files are listed on their jobs)."""
    return files_repo.list_page(
        session,
        project_id=project_id,
        after=after,
        limit=limit,
        newest_first=newest_first,
        purpose=purpose,
    )


def delete_file(session: Session, *, file: File) -> None:
    """Delete an upload; a 409 while a job that has not ended names it (it reads the file
    again on every start and resume), a 400 for a result file (it goes with its job)."""
    if result_files.job_id_of(file.id) is not None:
        raise InvalidRequest(
            "a result file cannot be deleted; it is deleted with its job", param="file_id"
        )
    job_id = jobs_repo.live_job_using_file(
        session,
        project_id=file.project_id,
        file_id=file.id,
        ended=[status.value for status in transitions.TERMINAL],
    )
    if job_id is not None:
        raise FileInUse(
            f"file {file.id} is used by job {job_id}, which has not ended; cancel it or wait",
            param="file_id",
        )
    files_repo.delete(session, file=file)


def content_chunks(session: Session, *, file: File) -> Iterator[bytes]:
    """What GET /v1/files/{id}/content sends: an upload's rows as JSONL (one validated row per
    line, as stored: the rows of a CSV or Parquet upload come back as JSONL too), or a result
    file's CSV."""
    job_id = result_files.job_id_of(file.id)
    if job_id is not None:
        yield from result_files.csv_chunks(session, job_id=job_id)
        return
    for start in range(0, len(file.rows), 1000):
        part = file.rows[start : start + 1000]
        yield "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in part).encode()


def media_type(file: File) -> str:
    return "text/csv" if result_files.job_id_of(file.id) is not None else "application/jsonl"
