"""`grpo keys create|list|revoke`, the operator's commands on the database (issue 32: there was
no command to revoke a key). A key revoked from the command line is refused at once by a running
API that had verified, and cached, it a moment before; on both backends (Postgres with Redis,
where the API processes cache keys, and the embedded SQLite, where they do not)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.settings import Settings
from app.main import create_app
from tests.cli.helpers import cli
from tests.conftest import settings_for


@pytest.fixture
def service(
    backend: str,
    request: pytest.FixtureRequest,
    sqlite_dir: Path,
    queue_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Settings:
    """The API's settings, also set in the environment the command reads."""
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    settings = settings_for(backend, url, sqlite_dir, queue_name)
    monkeypatch.setenv("GRPO_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("GRPO_DATABASE_URL", settings.resolved_database_url)
    monkeypatch.setenv("GRPO_BROKER_URL", settings.resolved_broker_url)
    return settings


def test_a_key_revoked_from_the_command_line_is_refused_at_once(service: Settings) -> None:
    project = "cli-keys-" + service.queue_name[-6:]
    created = cli("keys", "create", "--project", project, "--name", "ci")
    assert created.code == 0, created.err
    key = created.out.strip()
    listed = cli("keys", "list", "--project", project)
    assert listed.code == 0, listed.err
    (row,) = listed.out.splitlines()[1:]
    key_id, prefix, _, name, _, revoked_at = row.split("\t")
    assert (prefix, name, revoked_at) == (key.split("_")[1], "ci", "-")
    assert key_id in created.err  # the id to revoke it by is printed with the key

    with TestClient(create_app(service)) as client:
        headers = {"Authorization": f"Bearer {key}"}
        assert client.get("/v1/jobs", headers=headers).status_code == 200  # verified, cached
        revoked = cli("keys", "revoke", key_id)
        assert revoked.code == 0 and key_id in revoked.out, revoked.err
        assert client.get("/v1/jobs", headers=headers).status_code == 401

    (row,) = cli("keys", "list", "--project", project).out.splitlines()[1:]
    assert row.split("\t")[5] != "-"
    # The key itself names it as well; revoking again changes nothing; unknown keys are a 2.
    assert cli("keys", "revoke", key).code == 0
    unknown = cli("keys", "revoke", "key_0000")
    assert unknown.code == 2 and "no key" in unknown.err
    assert cli("keys", "list", "--project", "no-such-project").code == 2


def test_a_tinker_key_is_the_project_key_the_tinker_sdk_takes(service: Settings) -> None:
    project = "cli-tinker-" + service.queue_name[-6:]
    created = cli("keys", "create", "--project", project, "--tinker")
    assert created.code == 0, created.err
    key = created.out.strip().splitlines()[-1]  # its last line: what a user copies
    assert key.startswith("tml-grpo_")  # the SDK refuses any key without the tml- prefix
    with TestClient(create_app(service)) as client:
        capabilities = "/api/v1/get_server_capabilities"
        assert client.get(capabilities, headers={"X-API-Key": key}).status_code == 200
        assert (
            client.get("/v1/jobs", headers={"Authorization": f"Bearer {key[4:]}"}).status_code
            == 200
        )
        # The prefix alone, or the key without it, is not a Tinker key.
        assert client.get(capabilities, headers={"X-API-Key": key[4:]}).status_code == 401
        assert client.get(capabilities, headers={"X-API-Key": "tml-grpo_x_y"}).status_code == 401
        assert cli("keys", "revoke", key).code == 0  # revoked in its Tinker form too
        assert client.get(capabilities, headers={"X-API-Key": key}).status_code == 401
