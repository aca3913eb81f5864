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
from trainer.config import MAX_INLINE_ROWS, PromptRow

MAX_LINE_ERRORS = 20


def parse_jsonl(content: bytes) -> list[dict[str, Any]]:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest("file is not UTF-8 text", param="file") from exc
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(PromptRow.model_validate(json.loads(line)).model_dump())
        except json.JSONDecodeError as exc:
            errors.append({"line": number, "message": f"not JSON: {exc.msg}"})
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "row"
            errors.append({"line": number, "message": f"{field}: {first['msg']}"})
        if len(errors) >= MAX_LINE_ERRORS:
            break
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
    session: Session, project_id: str, filename: str, purpose: str, content: bytes
) -> File:
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
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, project_id: str, file_id: str) -> File:
    row = session.get(File, file_id)
    if row is None or row.project_id != project_id:
        raise NotFound(f"file {file_id} not found", param="file_id")
    return row
