"""The rows of an uploaded dataset: JSONL (one row object per line), CSV (a header, then one row
per line) or Parquet (one row per record), validated row by row so a user learns every bad row
at once, and decoded within one memory budget whatever the format.

A row is ``{prompt}`` or ``{messages}``, an optional ``answer`` and any other fields (kept for the
graders as ``item``; jobspec.dataset.PromptRow). The format comes from the file name
(``.csv``, ``.parquet``), JSONL otherwise. In a CSV every cell is text, except ``messages`` and
cells that hold a JSON object or list (written as JSON), and empty cells are left out.

Every reader streams: a line (a CSV record, a Parquet record) over the row limit is refused
before it is decoded, and what is decoded is charged to a
:class:`~jobspec.row_budget.RowBudget`, so an upload costs at most its body plus the
budget (jobspec/row_budget.py says why the numbers are what they are). JSONL and CSV are
charged whole, from byte counts, before their first row is decoded: a file that could expand
past the budget is refused in one pass over its bytes (well under a second for 16 MiB).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from app.core.errors import InvalidRequest, PayloadTooLarge
from jobspec import MAX_INLINE_ROWS, PromptRow
from jobspec.row_budget import RowBudget, RowBudgetExceeded, text_record_bound

__all__ = ["MAX_LINE_ERRORS", "parse_rows"]

MAX_LINE_ERRORS = 20

Parsed = tuple[int, dict[str, Any] | None, str | None]


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
        data = json.loads(line, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        # json's decoder recurses per nesting level and stops at the interpreter's limit; a
        # row is a flat object, so a line nested that deep is refused, never a 500.
        return None, "not a row: JSON nested too deeply"
    except ValueError as exc:  # _refuse_constant
        return None, f"not JSON: {exc}"
    return _validate_row(data)


def _not_utf8(where: str) -> InvalidRequest:
    return InvalidRequest(f"file is not UTF-8 text ({where})", param="file")


def _jsonl_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    # JSONL lines end with \n (or \r\n) only: str.splitlines would also split inside a JSON
    # string holding U+2028 or \x1c, which JSON allows unescaped. Lines are read one at a
    # time from the body, never as one decoded copy of it.
    return enumerate(io.BytesIO(content), start=1)


def _jsonl_rows(content: bytes, budget: RowBudget) -> Iterator[Parsed]:
    # Every line is charged (at its bound, from byte counts) before any is decoded: a file
    # whose rows could decode past the budget is refused in one pass over its bytes, not
    # after validating the rows that fit.
    for number, raw in _jsonl_lines(content):
        where = f"line {number}"
        budget.check_row_text(len(raw), where)
        budget.charge_text(raw, where)
    for number, raw in _jsonl_lines(content):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            raise _not_utf8(f"line {number}") from None
        if line.strip():
            yield number, *_parse_line(line.removesuffix("\n").removesuffix("\r"))


def _csv_cell(name: str, value: str) -> Any:
    """A CSV cell as a row field: JSON for messages and for cells holding an object or list."""
    if name == "messages" or value.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(value, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return value  # not JSON after all: the row's validation says what is wrong
    return value


def _csv_records(content: bytes) -> Iterator[tuple[int, dict[str, str] | None]]:
    """(line number, the record's non-empty cells) per record; None for a record with more
    cells than the header names."""
    text = io.TextIOWrapper(io.BytesIO(content), encoding="utf-8-sig", newline="")
    reader = csv.DictReader(text)
    try:
        if not reader.fieldnames:
            return
        for record in reader:
            if None in record:  # more cells than the header names
                yield reader.line_num, None
                continue
            yield reader.line_num, {k: v for k, v in record.items() if v not in ("", None)}
    except UnicodeDecodeError:
        raise _not_utf8(f"after line {reader.line_num}") from None


def _csv_rows(content: bytes, budget: RowBudget) -> Iterator[Parsed]:
    # As for JSONL, every record is charged before any is decoded. The csv module caps each
    # cell (131,072 characters); a record's cells together are capped and charged here, before
    # any of them is parsed as JSON.
    for line, cells in _csv_records(content):
        if cells is not None:
            where = f"line {line}"
            budget.check_row_text(sum(len(k) + len(v) for k, v in cells.items()), where)
            budget.charge_row(text_record_bound(cells), where)
    for line, cells in _csv_records(content):
        if cells is None:
            yield line, None, "more cells than the header has columns"
            continue
        data = {k: _csv_cell(k, v) for k, v in cells.items()}
        yield line, *_validate_row(data)


def _parquet_rows(content: bytes, budget: RowBudget) -> Iterator[Parsed]:
    # Only for Parquet uploads: the API starts without pyarrow loaded.
    from app.datasets.parquet_rows import parquet_records

    for number, data in parquet_records(content, budget):
        yield number, *_validate_row(data)


_FORMATS = {".csv": _csv_rows, ".parquet": _parquet_rows}


def parse_rows(content: bytes, filename: str = "") -> list[dict[str, Any]]:
    """Every row of an uploaded file (its format from ``filename``: see the module docstring).
    InvalidRequest (422) listing up to MAX_LINE_ERRORS bad rows by line (Parquet: record)
    number; PayloadTooLarge (413) when a row or the rows decode past the budget."""
    suffix = filename[filename.rfind(".") :].lower() if "." in filename else ""
    reader = _FORMATS.get(suffix, _jsonl_rows)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    try:
        for number, row, problem in reader(content, RowBudget()):
            if row is not None:
                rows.append(row)
            else:
                errors.append({"line": number, "message": problem})
            if len(errors) >= MAX_LINE_ERRORS or len(rows) > MAX_INLINE_ROWS:
                break  # enough to report; the rest of a too-long file is not worth parsing
    except csv.Error as exc:
        raise InvalidRequest(f"not a CSV file: {exc}", param="file") from None
    except RowBudgetExceeded as exc:
        raise PayloadTooLarge(str(exc), param="file") from None
    if errors:
        raise InvalidRequest(
            f"line {errors[0]['line']}: {errors[0]['message']}", param="file", details=errors
        )
    if not rows:
        raise InvalidRequest("file has no rows", param="file")
    if len(rows) > MAX_INLINE_ROWS:
        raise InvalidRequest(f"file has more than {MAX_INLINE_ROWS} rows", param="file")
    return rows
