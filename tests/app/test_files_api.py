"""Uploading JSONL datasets and referencing them from jobs."""

from __future__ import annotations

import json

from tests.conftest import Api, tiny_spec


def upload(api: Api, content: bytes, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return api.client.post(
        "/v1/files",
        files={"file": ("data.jsonl", content, "application/jsonl")},
        data={"purpose": "train"},
        headers=headers or api.headers,
    )


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
    content = b'{"prompt": "ok"}\nnot json\n{"prompt": ""}\n{"prompt": "x", "extra": 1}\n'
    response = upload(api, content)
    assert response.status_code == 422
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
