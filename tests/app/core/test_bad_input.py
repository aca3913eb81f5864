"""Bad input is a 4xx naming the field, never a 500: NUL characters (Postgres refuses them in
text), non-finite numbers (Python's json reads `Infinity`/`NaN`), JSON nested past the parser's
recursion limit, and odd path parameters. Every request below used to reach the database or
the JSON parser unchecked."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Api, tiny_spec

JOB_PATHS = ("", "/cancel", "/events", "/metrics", "/checkpoints", "/samples")


def _error(response: Any, status: int = 422) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def _upload(api: Api, content: bytes, filename: bytes = b"rows.jsonl") -> Any:
    """A multipart upload written by hand, so the filename's bytes reach the server as sent."""
    body = (
        b'--BOUNDARY\r\nContent-Disposition: form-data; name="file"; filename="'
        + filename
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        + content
        + b"\r\n--BOUNDARY--\r\n"
    )
    headers = {**api.headers, "Content-Type": "multipart/form-data; boundary=BOUNDARY"}
    return api.client.post("/v1/files", content=body, headers=headers)


def _raw_spec(api: Api, endpoint: str, body: str) -> Any:
    headers = {**api.headers, "Content-Type": "application/json"}
    return api.client.post(endpoint, content=body.encode(), headers=headers)


# ---- NUL characters --------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", JOB_PATHS)
def test_nul_in_a_job_id_names_job_id(api: Api, suffix: str) -> None:
    method = "POST" if suffix == "/cancel" else "GET"
    response = api.client.request(method, f"/v1/jobs/job_%00x{suffix}", headers=api.headers)
    error = _error(response)
    assert error["param"] == "job_id" and "NUL" in error["message"]


def test_nul_in_a_file_id_names_file_id(api: Api) -> None:
    # /v1/files is OpenAI-shaped: a bad request is a 400 there (the native API's is a 422).
    response = api.client.get("/v1/files/file_%00", headers=api.headers)
    assert _error(response, 400)["param"] == "file_id"


@pytest.mark.parametrize(
    ("url", "param"),
    [("/v1/jobs?after=job_%00", "after"), ("/v1/jobs?limit=5&after=%00", "after")],
)
def test_nul_in_a_cursor_names_the_cursor(api: Api, url: str, param: str) -> None:
    assert _error(api.client.get(url, headers=api.headers))["param"] == param


def test_nul_in_the_idempotency_key_names_the_header(api: Api) -> None:
    headers = {**api.headers, "Idempotency-Key": "retry\x00-1"}
    response = api.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert _error(response)["param"] == "Idempotency-Key"
    # Nothing was claimed or created: the same request with a clean key goes through.
    headers["Idempotency-Key"] = "retry-1"
    assert api.client.post("/v1/jobs", json=tiny_spec(), headers=headers).status_code == 201


def test_nul_in_the_api_key_is_a_client_error(api: Api) -> None:
    response = api.client.get("/v1/jobs", headers={"Authorization": "Bearer grpo_ab\x00_cd"})
    assert 400 <= response.status_code < 500, response.text


def test_nul_in_an_uploaded_filename_names_the_file(api: Api) -> None:
    response = _upload(api, b'{"prompt": "2+2?", "answer": "4"}\n', filename=b"rows\x00.jsonl")
    error = _error(response, 400)
    assert error["param"] == "file" and "NUL" in error["message"]


@pytest.mark.parametrize(
    "line",
    [
        b'{"prompt": "2+2?\\u0000", "answer": "4"}',
        b'{"prompt": "2+2?\x00", "answer": "4"}',
        b'{"prompt": "2+2?", "answer": "\\ud800"}',
    ],
    ids=["escaped NUL", "raw NUL", "lone surrogate"],
)
def test_unstorable_text_in_jsonl_content_names_the_line(api: Api, line: bytes) -> None:
    good = b'{"prompt": "1+1?", "answer": "2"}\n'
    error = _error(_upload(api, good + line + b"\n"), 400)
    assert error["param"] == "file"
    assert error["details"][0]["line"] == 2, error


def test_nul_in_the_spec_name_names_the_field(api: Api) -> None:
    spec = {**tiny_spec(), "name": "run\x00one"}
    for endpoint in ("/v1/jobs/validate", "/v1/jobs"):
        error = _error(api.client.post(endpoint, json=spec, headers=api.headers))
        assert error["param"] == "name", error


# ---- non-finite numbers and deep nesting -----------------------------------------------------


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("endpoint", ["/v1/jobs/validate", "/v1/jobs"])
def test_a_non_finite_float_in_the_spec_names_the_field(
    api: Api, endpoint: str, literal: str
) -> None:
    body = json.dumps(tiny_spec(learning_rate=123.5)).replace("123.5", literal)
    assert literal in body
    error = _error(_raw_spec(api, endpoint, body))
    assert error["param"] == "grpo.learning_rate", error


def test_a_non_finite_number_in_jsonl_names_the_line(api: Api) -> None:
    error = _error(_upload(api, b'{"prompt": "x", "answer": NaN}\n'), 400)
    assert error["param"] == "file" and "NaN" in error["message"], error


def test_a_jsonl_line_nested_100000_deep_names_the_line(api: Api) -> None:
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    good = b'{"prompt": "1+1?", "answer": "2"}\n'
    error = _error(_upload(api, good + deep + b"\n"), 400)
    assert error["param"] == "file"
    assert error["details"][0]["line"] == 2 and "nested" in error["message"], error


def test_a_request_body_nested_100000_deep_names_the_body(api: Api) -> None:
    body = '{"name": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for endpoint in ("/v1/jobs/validate", "/v1/jobs"):
        error = _error(_raw_spec(api, endpoint, body))
        assert error["param"] == "body" and "nested" in error["message"], error


def test_malformed_json_names_the_body(api: Api) -> None:
    error = _error(_raw_spec(api, "/v1/jobs/validate", '{"model": '))
    assert error["param"] == "body" and "JSON" in error["message"], error


# ---- odd path parameters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_id", "status"),
    [("j" * 5000, 422), ("jöb_🙂", 404), ("..", 404), ("%2e%2e", 404), ("job_%FF%FE", 404)],
)
def test_odd_job_ids_are_client_errors(api: Api, job_id: str, status: int) -> None:
    response = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers)
    assert response.status_code == status, response.text
    assert "error" in response.json()
