"""Fuzzing of POST /v1/files with multipart bodies, which the schema-driven suite
(test_openapi_fuzz.py) sends only well formed: random parts and field names, file names missing,
empty or odd, odd part content types, parts sent twice, broken framing (a cut body, no boundary,
another boundary, not multipart at all), and file contents that are random bytes, empty, over
the body limit, or JSONL, CSV and Parquet generated to be almost right (Parquet files written
from random tables, then possibly cut or with a byte flipped, or with text that is not UTF-8).

Every answer must be below 500, a status the published schema documents for the upload and,
when an error, the service's one error shape; an upload of good rows under a plain name must
succeed (JSONL, CSV or Parquet) whatever other fields the body holds, and every upload that
succeeds reads back as its rows."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.app.fuzz_target import Headers, Target

FUZZ = settings(
    deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)

FILES = "/v1/files"
BOUNDARY = "fuzzb0undary"
JSONL_LINES = (
    b'{"prompt": "2+2?", "answer": "4"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}',
    b'{"prompt": "a\\ud800"}',
    b'{"prompt": "a", "\\udfff": 1}',
    b'{"prompt": "x", "answer": NaN}',
    b'{"prompt": 7}',
    b"[1, 2]",
    b"\xef\xbb\xbf" + b'{"prompt": "bom"}',
    b'{"prompt": "' + b"\xff\xfe" + b'"}',
    b"",
    b"\r",
)


def _parquet(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def _not_utf8_column(rows: int) -> pa.Array:
    """A string column whose every value is two bytes that are not UTF-8 (pyarrow checks
    none of them, on writing or on reading)."""
    offsets = pa.array(range(0, 2 * rows + 1, 2), pa.int32()).buffers()[1]
    data = pa.py_buffer(b"\xff\xfe" * rows)
    return pa.Array.from_buffers(pa.string(), rows, [None, offsets, data])


columns = st.one_of(
    st.sampled_from(["prompt", "answer", "messages", "score", "x"]), st.text(max_size=10)
)
cells = st.one_of(
    st.none(), st.text(max_size=20), st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans()
)


@st.composite
def parquet_files(draw: st.DrawFn) -> bytes:
    rows = draw(st.integers(0, 3))
    names = draw(st.lists(columns, min_size=1, max_size=4, unique=True))
    table: dict[str, Any] = {}
    for name in names:
        kind = draw(st.sampled_from(["text", "cells", "list", "not utf-8"]))
        if kind == "not utf-8":
            table[name] = _not_utf8_column(rows)
        elif kind == "list":
            table[name] = pa.array(
                draw(st.lists(st.lists(st.text(max_size=5)), min_size=rows, max_size=rows))
            )
        elif kind == "cells":
            values = draw(st.lists(cells, min_size=rows, max_size=rows))
            try:
                table[name] = pa.array(values)
            except (pa.ArrowException, OverflowError):
                table[name] = pa.array([str(v) for v in values])
        else:
            table[name] = pa.array(
                draw(st.lists(st.text(max_size=20), min_size=rows, max_size=rows)), pa.string()
            )
    content = _parquet(pa.table(table))
    damage = draw(st.sampled_from(["none", "none", "none", "cut", "flip"]))
    if damage == "cut":
        content = content[: draw(st.integers(0, len(content)))]
    elif damage == "flip":
        at = draw(st.integers(0, len(content) - 1))
        content = (
            content[:at] + bytes([content[at] ^ draw(st.integers(1, 255))]) + content[at + 1 :]
        )
    return content


def _csv_text(draw: st.DrawFn) -> bytes:
    header = draw(st.lists(columns, min_size=1, max_size=3))
    rows = draw(st.lists(st.lists(st.text(max_size=10), max_size=4), max_size=3))
    lines = [",".join(header)] + [",".join(row) for row in rows]
    return "\n".join(lines).encode("utf-8", "replace")


def good_rows(extension: str, count: int) -> bytes:
    """``count`` rows every format must accept, as a file of the format."""
    prompts = [f"{n}+{n}?" for n in range(count)]
    answers = [str(2 * n) for n in range(count)]
    if extension == ".parquet":
        return _parquet(pa.table({"prompt": prompts, "answer": answers}))
    if extension == ".csv":
        lines = ["prompt,answer", *(f"{p},{a}" for p, a in zip(prompts, answers, strict=True))]
    else:
        lines = [
            json.dumps({"prompt": p, "answer": a}) for p, a in zip(prompts, answers, strict=True)
        ]
    return "\n".join(lines).encode() + b"\n"


KINDS = ("rows", "jsonl", "csv", "parquet", "bytes", "empty")
EXTENSIONS = (".jsonl", ".csv", ".parquet")


@st.composite
def good_files(draw: st.DrawFn) -> tuple[bytes, str, int]:
    extension, count = draw(st.sampled_from(EXTENSIONS)), draw(st.integers(1, 4))
    return good_rows(extension, count), extension, count


@st.composite
def file_contents(draw: st.DrawFn) -> tuple[bytes, str, int]:
    """Content for a file part, the file name extension its format has, and how many rows the
    upload must accept from it under a plain name (0: none, it may be refused)."""
    kind = draw(st.sampled_from([*KINDS, *KINDS[:4], "big"]))
    if kind == "rows":
        return draw(good_files())
    if kind == "jsonl":
        lines = draw(st.lists(st.sampled_from(JSONL_LINES), max_size=4))
        return b"\n".join(lines), ".jsonl", 0
    if kind == "csv":
        return _csv_text(draw), ".csv", 0
    if kind == "parquet":
        return draw(parquet_files()), ".parquet", 0
    if kind == "bytes":
        return draw(st.binary(max_size=300)), draw(st.sampled_from(EXTENSIONS)), 0
    if kind == "big":  # over the body limit
        return JSONL_LINES[0] * 2500, ".jsonl", 0
    return b"", draw(st.sampled_from(EXTENSIONS)), 0


filenames = st.one_of(
    st.sampled_from(["rows.jsonl", "rows.csv", "ROWS.PARQUET", "rows", ".csv", "", "../x.csv"]),
    st.text(max_size=30),
)
field_names = st.one_of(
    st.sampled_from(["purpose", "purpose", "file", "files", "File", ""]), st.text(max_size=8)
)
CONTENT_TYPES = (
    "application/octet-stream",
    "text/csv",
    "application/x-parquet",
    "multipart/mixed",
    "",
)
content_types = st.one_of(
    st.none(), st.none(), st.sampled_from(CONTENT_TYPES), st.text(max_size=20)
)
PURPOSES = ("train", "fine-tune")
FIELDS = ("file", "purpose")  # the upload's form fields


def _quoted(text: str) -> bytes:
    return text.replace("\\", "\\\\").replace('"', '\\"').encode("utf-8", "replace")


def _breaks(*texts: str | None) -> bool:
    """Whether a part's header text ends its line early (the body is then malformed)."""
    return any(text is not None and ("\r" in text or "\n" in text) for text in texts)


Part = tuple[bytes, int, bool]  # the part; rows it must be accepted with (0: none); spoils


@st.composite
def field_part(draw: st.DrawFn, name: str) -> Part:
    """A form field. It spoils an upload that would succeed when it is a purpose that is not
    one, or sits where the file should be."""
    head = b'Content-Disposition: form-data; name="' + _quoted(name) + b'"'
    value = draw(st.sampled_from([*PURPOSES, "", "other"]) | st.text(max_size=10))
    spoils = name == "file" or (name == "purpose" and value not in PURPOSES) or _breaks(name)
    return head + b"\r\n\r\n" + value.encode("utf-8", "replace"), 0, spoils


@st.composite
def file_part(draw: st.DrawFn, name: str, well_sent: bool = False) -> Part:
    """A file part, accepted with its rows when they are good rows under the plain name of
    their format; else it spoils an upload that would succeed when it takes a field's name.
    ``well_sent``: under its plain name, half of the time with good rows."""
    head = b'Content-Disposition: form-data; name="' + _quoted(name) + b'"'
    content, extension, rows = draw(
        st.one_of(good_files(), file_contents()) if well_sent else file_contents()
    )
    plain_name = "rows" + extension
    if well_sent:
        filename: str | None = plain_name
    else:
        filename = draw(st.one_of(st.just(plain_name), st.just(plain_name), st.none(), filenames))
    if filename is not None:
        head += b'; filename="' + _quoted(filename) + b'"'
    content_type = draw(content_types)
    if content_type is not None:
        head += b"\r\nContent-Type: " + content_type.encode("utf-8", "replace")
    plain = filename == plain_name and (content_type is None or content_type in CONTENT_TYPES)
    accepted = rows if name == "file" and plain else 0
    spoils = (name in FIELDS and not accepted) or _breaks(name, filename, content_type)
    return head + b"\r\n\r\n" + content, accepted, spoils


def parts(names: st.SearchStrategy[str]) -> st.SearchStrategy[Part]:
    return names.flatmap(lambda name: file_part(name) | field_part(name))


@st.composite
def uploads(draw: st.DrawFn) -> tuple[Headers, bytes, int]:
    """Headers and a body for POST /v1/files, mostly one file part under its right name with
    other parts around it; and the rows it must be accepted with (0: it may be refused)."""
    # One in three is well sent, among other parts: its content reaches the readers, and
    # half of those are good rows the API must accept.
    well_sent = draw(st.integers(0, 2)) == 0
    name = "file" if well_sent else draw(st.sampled_from(["file"] * 6 + ["files", "File", ""]))
    main = draw(file_part(name, well_sent=well_sent))
    extras = draw(st.lists(parts(field_names), max_size=2))
    drawn = draw(st.permutations([main, *extras]))
    if draw(st.integers(0, 4)) == 0:
        drawn = [*drawn, (drawn[0][0], 0, True)]  # a part sent twice
    delimiter = b"--" + BOUNDARY.encode()
    body = b"".join(delimiter + b"\r\n" + part + b"\r\n" for part, _, _ in drawn)
    body += delimiter + b"--\r\n"
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    framings = ["ok"] * 5 + ["cut", "no boundary", "other", "json"]
    framing = "ok" if well_sent else draw(st.sampled_from(framings))
    if framing == "cut":
        body = body[: draw(st.integers(0, len(body)))]
    elif framing == "no boundary":
        content_type = "multipart/form-data"
    elif framing == "other":
        content_type = "multipart/form-data; boundary=another"
    elif framing == "json":
        content_type = "application/json"
    spoiled = framing != "ok" or any(spoils for _, _, spoils in drawn)
    rows = 0 if spoiled else max(rows for _, rows, _ in drawn)
    return {"Content-Type": content_type}, body, rows


def test_multipart_upload_fuzz(fuzz_target: Target) -> None:
    target = fuzz_target
    limit = target.app.state.grpo.settings.max_body_bytes
    statuses: list[int] = []

    @given(upload=uploads())
    @settings(FUZZ, max_examples=300)
    def exercise(upload: tuple[Headers, bytes, int]) -> None:
        headers, body, rows = upload
        response = target.request("POST", FILES, headers=target.auth | headers, content=body)
        what = (headers, body[:300])
        target.check("POST", FILES, response, what)
        statuses.append(response.status_code)
        if rows and len(body) <= limit:
            assert response.status_code == 201, (what, response.text[:300])
            assert response.json()["row_count"] == rows, (what, response.text[:300])
        if response.status_code == 201:
            made = response.json()
            assert made["row_count"] >= 1, made
            # What was stored reads back: one JSONL line a row, whatever the upload's format.
            content = target.client.get(f"{FILES}/{made['id']}/content", headers=target.auth)
            assert content.status_code == 200, content.text
            assert len(content.content.splitlines()) == made["row_count"], made

    exercise()
    assert {201, 400, 413} <= set(statuses), statuses
