"""Uploaded datasets: JSONL (one row object per line), CSV (a header, then one row per line) or
Parquet (one row per record), validated row by row so a user learns every bad row at once.

A row is ``{prompt}`` or ``{messages}``, an optional ``answer`` and any other fields (kept for the
graders as ``item``; trainer.spec.dataset.PromptRow). The format comes from the file name
(``.csv``, ``.parquet``), JSONL otherwise. In a CSV every cell is text, except ``messages`` and
cells that hold a JSON object or list (written as JSON), and empty cells are left out.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app import transitions
from app.clock import utcnow
from app.errors import FileInUse, InvalidRequest, NotFound
from app.ids import new_id
from app.models import File
from app.repositories import files as files_repo
from app.repositories import jobs as jobs_repo
from app.services import result_files
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


def _validate_row(data: Any) -> tuple[dict[str, Any] | None, str | None]:
    """One stored row (the fields it was given), or why ``data`` is not a row."""
    try:
        return PromptRow.model_validate(data).item, None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "row"
        return None, f"{field}: {str(first['msg']).removeprefix('Value error, ')}"


def _parse_line(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """One row, or why the line is not one (a message without the line number)."""
    try:
        return _validate_row(json.loads(line, parse_constant=_refuse_constant))
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        # json's decoder recurses per nesting level and stops at the interpreter's limit; a
        # row is a flat object, so a line nested that deep is refused, never a 500.
        return None, "not a row: JSON nested too deeply"
    except ValueError as exc:  # _refuse_constant
        return None, f"not JSON: {exc}"


def _text(content: bytes) -> str:
    try:
        return content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequest("file is not UTF-8 text", param="file") from exc


def _jsonl_rows(content: bytes) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    # JSONL lines end with \n (or \r\n) only: str.splitlines would also split inside a JSON
    # string holding U+2028 or \x1c, which JSON allows unescaped.
    for number, line in enumerate(_text(content).split("\n"), start=1):
        if line.strip():
            yield number, *_parse_line(line.removesuffix("\r"))


def _csv_cell(name: str, value: str) -> Any:
    """A CSV cell as a row field: JSON for messages and for cells holding an object or list."""
    if name == "messages" or value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return value  # not JSON after all: the row's validation says what is wrong
    return value


def _csv_rows(content: bytes) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    reader = csv.DictReader(io.StringIO(_text(content), newline=""))
    if not reader.fieldnames:
        return
    for record in reader:
        line = reader.line_num
        if None in record:  # more cells than the header names
            yield line, None, "more cells than the header has columns"
            continue
        data = {k: _csv_cell(k, v) for k, v in record.items() if v not in ("", None)}
        yield line, *_validate_row(data)


def _parquet_rows(content: bytes) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    import pyarrow.parquet as pq  # only for Parquet uploads: the API starts without it

    try:
        table = pq.read_table(io.BytesIO(content))
    except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
        raise InvalidRequest(f"not a Parquet file ({type(exc).__name__})", param="file") from None
    if table.num_rows > MAX_INLINE_ROWS:
        raise InvalidRequest(f"file has more than {MAX_INLINE_ROWS} rows", param="file")
    for number, record in enumerate(table.to_pylist(), start=1):
        data = {k: v for k, v in record.items() if v is not None}
        yield number, *_validate_row(data)


_FORMATS = {".csv": _csv_rows, ".parquet": _parquet_rows}


def parse_rows(content: bytes, filename: str = "") -> list[dict[str, Any]]:
    """Every row of an uploaded file (its format from ``filename``: see the module docstring),
    or InvalidRequest listing up to MAX_LINE_ERRORS bad rows by line (Parquet: record) number."""
    suffix = filename[filename.rfind(".") :].lower() if "." in filename else ""
    reader = _FORMATS.get(suffix, _jsonl_rows)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    try:
        for number, row, problem in reader(content):
            if row is not None:
                rows.append(row)
            else:
                errors.append({"line": number, "message": problem})
            if len(errors) >= MAX_LINE_ERRORS or len(rows) > MAX_INLINE_ROWS:
                break  # enough to report; the rest of a too-long file is not worth parsing
    except csv.Error as exc:
        raise InvalidRequest(f"not a CSV file: {exc}", param="file") from None
    if errors:
        raise InvalidRequest(
            f"line {errors[0]['line']}: {errors[0]['message']}", param="file", details=errors
        )
    if not rows:
        raise InvalidRequest("file has no rows", param="file")
    if len(rows) > MAX_INLINE_ROWS:
        raise InvalidRequest(f"file has more than {MAX_INLINE_ROWS} rows", param="file")
    return rows


def parse_jsonl(content: bytes) -> list[dict[str, Any]]:
    """The rows of a JSONL upload (:func:`parse_rows` of a ``.jsonl`` file)."""
    return parse_rows(content, "upload.jsonl")


def create_file(
    session: Session, *, project_id: str, filename: str, purpose: str, content: bytes
) -> File:
    """Validate every line, then store the rows (flushed; the request commits)."""
    problem = text_problem(filename)
    if problem is not None:  # stored as text: Postgres refuses NUL
        raise InvalidRequest(f"file name {problem}", param="file")
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
