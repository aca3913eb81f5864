"""Uploaded datasets: JSONL, one {"prompt": ..., "answer": ...} object per line, validated line by
line so a user learns every bad line at once."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.clock import utcnow
from app.errors import InvalidRequest, NotFound
from app.ids import new_id
from app.models import File
from app.repositories import files as files_repo
from trainer.config import MAX_INLINE_ROWS, PromptRow, text_problem

MAX_LINE_ERRORS = 20
# A job's inline rows above this much JSON are stored as a file of the project instead, and
# the stored spec names the file: a job row is read by every list, claim and sweep, and rows
# kept inline would ride along each time (20 jobs with large inline datasets made one list
# call 308 MB). 256 KiB keeps a full page of 100 jobs under ~25 MB of stored spec.
SPILL_INLINE_ROWS_BYTES = 256 * 1024


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN/Infinity/-Infinity, which are not JSON (RFC 8259) and which no
    # row field can hold; refuse them by name instead of letting a type error hide the cause.
    raise ValueError(f"{name} is not a JSON number")


def _parse_line(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """One row, or why the line is not one (a message without the line number)."""
    try:
        return PromptRow.model_validate(
            json.loads(line, parse_constant=_refuse_constant)
        ).model_dump(), None
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        # json's decoder recurses per nesting level and stops at the interpreter's limit; a
        # row is a flat object, so a line nested that deep is refused, never a 500.
        return None, "not a row: JSON nested too deeply"
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "row"
        return None, f"{field}: {str(first['msg']).removeprefix('Value error, ')}"
    except ValueError as exc:  # _refuse_constant
        return None, f"not JSON: {exc}"


def parse_jsonl(content: bytes) -> list[dict[str, Any]]:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest("file is not UTF-8 text", param="file") from exc
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    # JSONL lines end with \n (or \r\n) only: str.splitlines would also split inside a JSON
    # string holding U+2028 or \x1c, which JSON allows unescaped.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        row, problem = _parse_line(line.removesuffix("\r"))
        if row is not None:
            rows.append(row)
        else:
            errors.append({"line": number, "message": problem})
        if len(errors) >= MAX_LINE_ERRORS or len(rows) > MAX_INLINE_ROWS:
            break  # enough to report; the rest of a too-long file is not worth parsing
    if errors:
        raise InvalidRequest(
            f"line {errors[0]['line']}: {errors[0]['message']}", param="file", details=errors
        )
    if not rows:
        raise InvalidRequest("file has no rows", param="file")
    if len(rows) > MAX_INLINE_ROWS:
        raise InvalidRequest(f"file has more than {MAX_INLINE_ROWS} rows", param="file")
    return rows


def create_file(
    session: Session, *, project_id: str, filename: str, purpose: str, content: bytes
) -> File:
    """Validate every line, then store the rows (flushed; the request commits)."""
    problem = text_problem(filename)
    if problem is not None:  # stored as text: Postgres refuses NUL
        raise InvalidRequest(f"file name {problem}", param="file")
    rows = parse_jsonl(content)
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
    """The project's file, or NotFound naming `file_id`."""
    row = files_repo.get_for_project(session, project_id=project_id, file_id=file_id)
    if row is None:
        raise NotFound(f"file {file_id} not found", param="file_id")
    return row


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
