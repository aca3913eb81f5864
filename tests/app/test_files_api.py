"""Uploading datasets (JSONL, CSV, Parquet) and referencing them from jobs."""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from app.db import make_engine, make_session_factory, session_scope
from app.models import File
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
