"""Schemathesis drives every operation of the published OpenAPI schema with generated requests
(bounded examples) against the real app on Postgres: no 5xx, and every response matches the
schema it is documented with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
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
    cfg = settings_for("postgres", pg_url, sqlite_dir, queue_name, max_body_bytes=256 * 1024)
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
