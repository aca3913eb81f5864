"""Schemathesis drives every operation of the published OpenAPI schema with generated requests
(bounded examples) against the real app on Postgres: no 5xx, and every response matches the
schema it is documented with.

A second pass poisons each generated request where generators rarely go: a NUL character (which
Postgres refuses in text) in a path parameter, a query parameter, a header or any string of a
JSON body; a non-finite number (`Infinity`, `-Infinity`, `NaN`: Python's json reads them) in
place of any number of a body; NUL, non-finite numbers and deep nesting in an uploaded JSONL
file and its name. Each must be a 4xx naming the field, never a 5xx."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from tests.conftest import new_project_key, settings_for

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
AUTH: dict[str, str] = {}


@pytest.fixture(scope="module")
def fuzz_app(pg_url: str, sqlite_dir: Path, queue_name: str) -> Iterator[FastAPI]:
    # Fair-use limits high enough that the fuzzer explores the API, not the 429 path.
    cfg = settings_for(
        "postgres",
        pg_url,
        sqlite_dir,
        queue_name,
        max_body_bytes=256 * 1024,
        rate_limit_per_minute=1_000_000,
        rate_limit_burst=100_000,
        max_active_jobs_per_project=100_000,
        max_active_devices_per_project=1_000_000,
        # Generated webhook URLs are never looked up in DNS (no network but loopback in tests).
        webhook_allow_private=True,
    )
    key, _ = new_project_key(cfg)
    AUTH["Authorization"] = f"Bearer {key}"
    app = create_app(cfg)
    with TestClient(app):
        yield app


@pytest.fixture(scope="module")
def api_schema(fuzz_app: FastAPI) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def test_api_conforms_to_its_schema(api_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 9
    statuses: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def exercise(case: schemathesis.Case) -> None:
            response = case.call_and_validate(headers=dict(AUTH), checks=CHECKS)
            statuses.append(response.status_code)

        exercise()
    # The fuzzer really got past authentication and validation, not only into error paths.
    assert any(200 <= code < 300 for code in statuses)
    assert any(code == 422 for code in statuses)


# ---- the poisoned pass ------------------------------------------------------------------------

NON_FINITE = (math.inf, -math.inf, math.nan)
HEADERS = ("Idempotency-Key", "Last-Event-ID", "User-Agent", "Accept-Language")
JSONL_LINES = (
    b'{"prompt": "2+2?", "answer": "4"}',
    b'{"prompt": "2+2?\\u0000", "answer": "4"}',
    b'{"prompt": "2+2?\x00", "answer": "4"}',
    b'{"prompt": "2+2?", "answer": Infinity}',
    b'{"prompt": NaN}',
    b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    b"\x00",
)
BOUNDARY = "fuzzboundary"


@dataclass
class Poisoned:
    """A request built from a generated case with one value poisoned; sent raw, so a NUL or an
    `Infinity` literal reaches the server as written (clients would refuse or escape them)."""

    method: str
    path: str
    what: str
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None


def _leaves(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every string and number inside a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*at, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*at, i))
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        yield at, value


def _replace(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    out = copy.copy(value)
    out[at[0]] = _replace(value[at[0]], at[1:], new)
    return out


def _with_nul(draw: st.DrawFn, text: object) -> str:
    text = "" if text is None else str(text)
    at = draw(st.integers(0, len(text)))
    return text[:at] + "\x00" + text[at:]


def _multipart(filename: bytes, content: bytes) -> bytes:
    return (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
        + filename
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        + content
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


@st.composite
def poisoned(draw: st.DrawFn, operation: Any) -> Poisoned:
    case = draw(operation.as_strategy())
    path_params = {k: str(v) for k, v in (case.path_parameters or {}).items()}
    query = dict(case.query or {})
    body = case.body if isinstance(case.body, dict | list) else None
    upload = any(b.media_type.startswith("multipart/") for b in operation.body)
    targets = ["header"]
    targets += ["path"] if path_params else []
    targets += ["query"] if list(operation.query) else []
    targets += ["body"] if body is not None and not upload else []
    targets += ["upload"] if upload else []
    target = draw(st.sampled_from(targets))
    headers: dict[str, str] = {}
    content: bytes | None = None
    what = target
    if target == "path":
        name = draw(st.sampled_from(sorted(path_params)))
        path_params[name] = _with_nul(draw, path_params[name])
        what = f"path {name}"
    elif target == "query":
        name = draw(st.sampled_from([p.name for p in operation.query]))
        query[name] = _with_nul(draw, query.get(name))
        what = f"query {name}"
    elif target == "header":
        name = draw(st.sampled_from(HEADERS))
        headers[name] = _with_nul(draw, "value")
        what = f"header {name}"
    if body is not None and not upload:
        if target == "body":
            leaves = list(_leaves(body))
            if leaves:
                at, leaf = draw(st.sampled_from(leaves))
                poison: object = _with_nul(draw, leaf)
                if isinstance(leaf, int | float) and draw(st.booleans()):
                    poison = draw(st.sampled_from(NON_FINITE))
                body = _replace(body, at, poison)
                what = f"body at {list(at)}: {poison!r:.40}"
            else:
                body = {"name": "\x00"}
        content = json.dumps(body, allow_nan=True).encode()  # Infinity/NaN literals on purpose
        headers["Content-Type"] = "application/json"
    if upload:
        lines = draw(st.lists(st.sampled_from(JSONL_LINES), min_size=1, max_size=3))
        name = draw(st.sampled_from([b"rows.jsonl", b"rows\x00.jsonl", b"\x00"]))
        content = _multipart(name, b"\n".join(lines) + b"\n")
        headers["Content-Type"] = f"multipart/form-data; boundary={BOUNDARY}"
        what += f" upload {name!r} lines {[line[:40] for line in lines]}"
    path = operation.path
    for name, value in path_params.items():
        path = path.replace("{" + name + "}", quote(value, safe=""))
    return Poisoned(operation.method.upper(), path, what, query, headers, content)


def test_poisoned_requests_are_client_errors(
    fuzz_app: FastAPI, api_schema: schemathesis.BaseSchema
) -> None:
    client = TestClient(fuzz_app, raise_server_exceptions=False)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    seen: list[str] = []
    for operation in operations:

        @given(request=poisoned(operation))
        @settings(
            max_examples=20,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def exercise(request: Poisoned) -> None:
            response = client.request(
                request.method,
                request.path,
                params=request.params,
                headers={**AUTH, **request.headers},
                content=request.content,
            )
            where = f"{request.method} {request.path} ({request.what})"
            assert response.status_code < 500, (where, response.text[:300])
            if response.status_code == 422:
                error = response.json()["error"]
                assert error["param"], (where, error)
            seen.append(request.what)

        exercise()
    # Every kind of poison was really sent.
    for kind in ("path", "query", "header", "body at", "upload"):
        assert any(kind in what for what in seen), kind
