"""A new job's large inline rows, stored as a file of the project (the stored spec names it)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.ids import new_id
from app.core.models import File
from app.datasets import repository as files_repo

# A job's inline rows above this much JSON are stored as a file of the project instead, and
# the stored spec names the file: a job row is read by every list, claim and sweep, and rows
# kept inline would ride along each time (20 jobs with large inline datasets made one list
# call 308 MB). 256 KiB keeps a full page of 100 jobs under ~25 MB of stored spec.
SPILL_INLINE_ROWS_BYTES = 256 * 1024


def spill_inline_rows(session: Session, *, project_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The spec to store for a new job: as given, or, when its inline `dataset.rows` exceed
    SPILL_INLINE_ROWS_BYTES of JSON lines, with the rows moved into a new file of the project
    and `dataset.file_id` naming it (the worker resolves file ids into rows; the rows were
    validated with the spec). Flushed; the request commits."""
    dataset = spec.get("dataset")
    if not isinstance(dataset, dict) or not dataset.get("rows"):
        return spec
    rows = dataset["rows"]
    size = sum(len(json.dumps(row, ensure_ascii=False).encode()) + 1 for row in rows)  # JSONL
    if size <= SPILL_INLINE_ROWS_BYTES:
        return spec
    file = files_repo.add(
        session,
        file=File(
            id=new_id("file"),
            project_id=project_id,
            filename="inline-rows.jsonl",
            purpose="train",
            bytes=size,
            row_count=len(rows),
            rows=rows,
            created_at=utcnow(),
        ),
    )
    return {**spec, "dataset": {**dataset, "rows": None, "file_id": file.id}}
