"""Uploading datasets (JSONL, CSV, Parquet) and referencing them from jobs."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.errors import PayloadTooLarge
from app.core.models import File
from app.datasets import parquet_rows, upload_rows
from tests.conftest import Api, tiny_spec


def upload(
    api: Api, content: bytes, headers: dict[str, str] | None = None, name: str = "data.jsonl"
):  # type: ignore[no-untyped-def]
    return api.client.post(
        "/v1/files",
        files={"file": (name, content, "application/octet-stream")},
        data={"purpose": "train"},
        headers=headers or api.headers,
    )


def stored_rows(api: Api, file_id: str) -> list[dict[str, Any]]:
    sessions = make_session_factory(make_engine(api.settings.resolved_database_url))
    with session_scope(sessions) as session:
        row = session.get(File, file_id)
        assert row is not None
        return list(row.rows)


def test_upload_and_use_in_a_job(api: Api) -> None:
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)]
    content = "\n".join(json.dumps(r) for r in rows).encode()
    response = upload(api, content)
    assert response.status_code == 201, response.text
    file = response.json()
    assert file["row_count"] == 5 and file["bytes"] == len(content)
    assert api.client.get(f"/v1/files/{file['id']}", headers=api.headers).json()["id"] == file["id"]
    spec = tiny_spec() | {"dataset": {"file_id": file["id"]}}
    checked = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
    assert checked.status_code == 200 and checked.json()["dataset_rows"] == 5
    assert api.client.post("/v1/jobs", json=spec, headers=api.headers).status_code == 201


def test_bad_lines_are_reported_by_number(api: Api) -> None:
    content = b'{"prompt": "ok"}\nnot json\n{"prompt": ""}\n{"prompt": "x", "bad key": 1}\n'
    response = upload(api, content)
    assert response.status_code == 400  # OpenAI-compatible path: 400, not 422
    error = response.json()["error"]
    assert error["param"] == "file"
    assert [d["line"] for d in error["details"]] == [2, 3, 4]


def test_files_are_project_scoped(api: Api) -> None:
    file_id = upload(api, b'{"prompt": "a"}').json()["id"]
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    assert api.client.get(f"/v1/files/{file_id}", headers=other).status_code == 404
    spec = tiny_spec() | {"dataset": {"file_id": file_id}}
    response = api.client.post("/v1/jobs", json=spec, headers=other)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "dataset.file_id"


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def test_rows_keep_messages_and_every_other_field_for_the_graders(api: Api) -> None:
    rows = [
        {"messages": MESSAGES, "answer": "4", "test_cases": [{"in": 1, "out": 2}]},
        {"prompt": "3+3?", "answer": "6", "difficulty": "easy"},
    ]
    response = upload(api, "\n".join(json.dumps(r) for r in rows).encode())
    assert response.status_code == 201, response.text
    assert stored_rows(api, response.json()["id"]) == rows


def test_csv_uploads_with_json_cells_and_errors_by_line(api: Api) -> None:
    content = b'prompt,answer,tags\n"What is 1+1?",2,"[""math""]"\nWhat is 2+2?,4,\n'
    response = upload(api, content, name="data.csv")
    assert response.status_code == 201, response.text
    assert stored_rows(api, response.json()["id"]) == [
        {"prompt": "What is 1+1?", "answer": "2", "tags": ["math"]},
        {"prompt": "What is 2+2?", "answer": "4"},
    ]
    bad = b"prompt,answer\nok,1\n,2\nx,3,extra\n"
    refused = upload(api, bad, name="bad.csv")
    assert refused.status_code == 400
    assert [d["line"] for d in refused.json()["error"]["details"]] == [3, 4]


def test_parquet_uploads(api: Api) -> None:
    table = pa.table(
        {
            "prompt": ["a?", None],
            "messages": [None, MESSAGES],
            "answer": ["1", "4"],
            "score": [0.5, 1.5],
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    response = upload(api, buffer.getvalue(), name="data.parquet")
    assert response.status_code == 201, response.text
    assert stored_rows(api, response.json()["id"]) == [
        {"prompt": "a?", "answer": "1", "score": 0.5},
        {"messages": MESSAGES, "answer": "4", "score": 1.5},
    ]
    garbage = upload(api, b"PAR1 not really", name="x.parquet")
    assert garbage.status_code == 400 and garbage.json()["error"]["param"] == "file"


def test_a_parquet_text_column_that_is_not_utf8_is_a_400(api: Api) -> None:
    """pyarrow writes and reads a string column's bytes unchecked; they were decoded only when a
    record became Python objects, and the UnicodeDecodeError was a 500 (found by
    tests/app/core/test_header_fuzz.py)."""
    offsets = pa.array([0, 2, 4], pa.int32()).buffers()[1]
    text = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    response = upload(api, _parquet(pa.table({"prompt": text})), name="data.parquet")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "not UTF-8" in error["message"], error


def _parquet(table: pa.Table, **options: Any) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **options)
    return buffer.getvalue()


def test_a_parquet_file_is_refused_from_its_footer(api: Api) -> None:
    """Column types no row field can hold, too many columns, too many rows: refused before a
    record is read, naming the file."""
    cases = {
        "binary": _parquet(pa.table({"prompt": ["a"], "blob": pa.array([b"\x00"], pa.binary())})),
        "timestamp": _parquet(pa.table({"prompt": ["a"], "at": pa.array([0], pa.timestamp("s"))})),
        "columns": _parquet(pa.table({f"c{i}": ["a"] for i in range(300)})),
        "rows": _parquet(pa.table({"prompt": pa.array(["a"] * 100_001)})),
    }
    for case, content in cases.items():
        response = upload(api, content, name="x.parquet")
        assert response.status_code == 400, (case, response.text)
        assert response.json()["error"]["param"] == "file", case


def test_a_parquet_file_of_too_many_row_groups_is_refused_from_its_footer(api: Api) -> None:
    """Each row group is read as a batch of its own, at a fixed cost: 45,000 one-row groups
    (6.6 MB) cost 40 s of an API process's CPU (issue 32). One group past the limit is refused
    before any is read, naming the limit; a file at the limit is read."""
    limit = parquet_rows.MAX_PARQUET_ROW_GROUPS
    table = pa.table({"prompt": pa.array([f"q{i}" for i in range(limit + 1)])})
    refused = upload(api, _parquet(table, row_group_size=1), name="groups.parquet")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "file" and f"{limit + 1} row groups" in error["message"]
    assert f"more than {limit}" in error["message"]
    at_limit = _parquet(table.slice(0, limit), row_group_size=1)
    accepted = upload(api, at_limit, name="groups.parquet")
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["row_count"] == limit


def test_a_dictionary_bomb_is_refused_before_its_rows_are_built(api: Api) -> None:
    """One 1 MB value referenced by 5,000 records (517 bytes on the wire, 5 GB decoded): each
    record is charged from the Arrow buffers before any becomes Python."""
    long = pa.array(["x" * 1_000_000])
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 5_000, pa.int32()), long)
    content = _parquet(pa.table({"prompt": column}), compression="zstd")
    assert len(content) < 1_000
    response = upload(api, content, name="bomb.parquet")
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["code"] == "payload_too_large"


def test_nested_text_columns_are_charged_through_their_dictionaries(api: Api) -> None:
    """A bomb inside messages (list<struct<dictionary string>>) is caught as well, and the same
    nested shape with ordinary text is read."""
    one_long = [{"role": "user", "content": "y" * 15_000}]
    table = pa.table({"messages": [one_long] * 20_000})
    response = upload(api, _parquet(table, compression="zstd"), name="nested.parquet")
    assert response.status_code == 413, response.text
    fine = pa.table({"messages": [MESSAGES] * 3})
    accepted = upload(api, _parquet(fine), name="fine.parquet")
    assert accepted.status_code == 201, accepted.text


def test_text_rows_that_expand_past_the_budget_are_refused(make_api: Any) -> None:
    """JSONL and CSV: a row whose text could decode past the per-row bound is refused undecoded
    (413 naming its line); so are rows past the line limit."""
    api = make_api()  # the default body limit, not the small one of the `api` fixture
    nested = json.dumps({"prompt": "a", "pad": [[]] * 200_000}).encode()
    refused = upload(api, nested + b"\n")
    assert refused.status_code == 413
    assert refused.json()["error"]["message"].startswith("line 1 could decode to")
    long_line = json.dumps({"prompt": "a", "note": "z" * (1024 * 1024)}).encode()
    assert upload(api, long_line).status_code == 413
    cell = '"' + json.dumps([[]] * 30_000).replace('"', '""') + '"'
    csv_rows = ("prompt,a,b,c,d,e\n" + "p," + ",".join([cell] * 5) + "\n").encode()
    assert upload(api, csv_rows, name="x.csv").status_code == 413


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.csv"])
def test_a_file_that_could_expand_past_the_budget_is_refused_before_any_row_is_decoded(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows each within their own bounds whose total could pass the dataset's budget: the 413
    comes from the byte counts alone, before the first row is parsed or validated (before,
    the rows that fitted were validated first: seconds of CPU for a 16 MiB file)."""
    pad = [[]] * 24_000
    if name.endswith(".jsonl"):
        line = json.dumps({"prompt": "a", "p0": pad, "p1": pad, "p2": pad}) + "\n"
        content = (line * 60).encode()
    else:
        cell = '"' + json.dumps(pad).replace('"', '""') + '"'
        content = ("prompt,p0,p1,p2\n" + ("a," + ",".join([cell] * 3) + "\n") * 60).encode()
    decoded: list[object] = []
    monkeypatch.setattr(upload_rows, "_validate_row", lambda data: decoded.append(data))
    monkeypatch.setattr(upload_rows.json, "loads", lambda *a, **k: decoded.append(a))
    with pytest.raises(PayloadTooLarge) as refused:
        upload_rows.parse_rows(content, name)
    assert "decode to more than 256 MiB" in refused.value.message
    assert decoded == []


def test_uploads_wait_for_a_decoding_slot_then_get_429_or_503(make_api: Any) -> None:
    """Decoding slots per process, fairly shared: a project at its share gets 429, another
    project while every slot is taken 503, both with Retry-After naming the setting; a freed
    slot serves the next upload."""
    api = make_api(
        max_concurrent_uploads=1, max_concurrent_uploads_per_project=1, upload_queue_timeout_s=0
    )
    slots = api.client.app.state.grpo.uploads
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    content = b'{"prompt": "2+2?", "answer": "4"}\n'
    held = slots.acquire(api.project_id)
    try:
        own = upload(api, content)
        assert own.status_code == 429 and int(own.headers["Retry-After"]) >= 1
        assert "GRPO_MAX_CONCURRENT_UPLOADS_PER_PROJECT" in own.json()["error"]["message"]
        everyone = upload(api, content, headers=other)
        assert everyone.status_code == 503 and int(everyone.headers["Retry-After"]) >= 1
        assert "GRPO_MAX_CONCURRENT_UPLOADS=1" in everyone.json()["error"]["message"]
    finally:
        slots.release(held)
    assert upload(api, content, headers=other).status_code == 201
    assert slots.held(api.project_id) == 0
