"""Revoking API keys (issue 32, hostile tenant: there was no command or API to revoke one).
`DELETE /v1/keys/{id}` revokes a key of the caller's own project only (another project's is the
same 404 as an unknown id); from its answer on the key, and its dashboard sessions, get 401 at
once, in every API process, however fresh their cached verification of it."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi.testclient import TestClient

from tests.app.conftest import ApiProcesses
from tests.conftest import Api, new_project_key

CSRF = {"X-Requested-With": "test"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id(client: TestClient, key: str) -> str:
    who = client.get("/v1/session", headers=bearer(key))
    assert who.status_code == 200, who.text
    return str(who.json()["key_id"])


def test_a_project_revokes_its_own_keys_and_they_are_refused_at_once(api: Api) -> None:
    project = f"p-{secrets.token_hex(4)}"
    admin, _ = api.new_key(project)
    leaked, _ = api.new_key(project)
    client = api.client
    leaked_id = key_id(client, leaked)  # verified, so cached by this process from now on
    assert client.get("/v1/jobs", headers=bearer(leaked)).status_code == 200
    # A dashboard session of the leaked key ends with it.
    browser = TestClient(client.app)
    assert browser.post("/v1/session", json={"key": leaked}, headers=CSRF).status_code == 200
    assert browser.get("/v1/jobs").status_code == 200

    revoked = client.delete(f"/v1/keys/{leaked_id}", headers=bearer(admin))
    assert revoked.status_code == 200, revoked.text
    body = revoked.json()
    assert body["id"] == leaked_id and body["revoked_at"] is not None
    assert "secret_hash" not in body and leaked.split("_", 2)[2] not in revoked.text
    # At once: no wait for the key cache.
    assert client.get("/v1/jobs", headers=bearer(leaked)).status_code == 401
    assert browser.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers=bearer(admin)).status_code == 200

    # Idempotent: the first revocation's time stands.
    again = client.delete(f"/v1/keys/{leaked_id}", headers=bearer(admin))
    assert again.status_code == 200 and again.json()["revoked_at"] == body["revoked_at"]
    listed = client.get("/v1/keys", headers=bearer(admin)).json()["data"]
    by_id = {k["id"]: k for k in listed}
    assert set(by_id) == {leaked_id, key_id(client, admin)}
    assert by_id[leaked_id]["revoked_at"] == body["revoked_at"]
    assert by_id[leaked_id]["prefix"] == leaked.split("_")[1]

    # A key may revoke itself (a rotation's last step).
    admin_id = key_id(client, admin)
    assert client.delete(f"/v1/keys/{admin_id}", headers=bearer(admin)).status_code == 200
    assert client.get("/v1/jobs", headers=bearer(admin)).status_code == 401


def test_a_key_never_reaches_another_projects_keys(api: Api) -> None:
    theirs, _ = api.new_key()
    their_id = key_id(api.client, theirs)
    for path in (f"/v1/keys/{their_id}", f"/v1/keys/key_{secrets.token_hex(14)}"):
        refused = api.client.delete(path, headers=api.headers)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["param"] == "key_id"
    listed = api.client.get("/v1/keys", headers=api.headers).json()["data"]
    assert their_id not in {k["id"] for k in listed}
    assert api.client.get("/v1/jobs", headers=bearer(theirs)).status_code == 200
    assert api.client.delete("/v1/keys/x", headers={}).status_code == 401


def test_a_revocation_holds_at_once_in_every_api_process(api_processes: ApiProcesses) -> None:
    """`grpo api --workers 2` on Postgres and Redis: both processes have verified (and cached)
    the key when it is revoked; the very next requests, spread over both, are all refused."""
    who = httpx.get(f"{api_processes.url}/v1/session", headers=api_processes.headers).json()
    doomed, _ = new_project_key(api_processes.server.settings, who["project_name"])

    def statuses(key: str, count: int = 24) -> list[int]:
        # Each on a connection of its own: the kernel spreads them over both processes.
        def one(_: int) -> int:
            with httpx.Client(base_url=api_processes.url, timeout=30) as client:
                return client.get("/v1/jobs?limit=1", headers=bearer(key)).status_code

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, range(count)))

    assert set(statuses(doomed)) == {200}  # verified by both processes: cached for seconds
    doomed_id = httpx.get(f"{api_processes.url}/v1/session", headers=bearer(doomed)).json()
    revoked = httpx.delete(
        f"{api_processes.url}/v1/keys/{doomed_id['key_id']}", headers=api_processes.headers
    )
    assert revoked.status_code == 200, revoked.text
    assert set(statuses(doomed)) == {401}
    assert set(statuses(api_processes.headers["Authorization"][7:], 4)) == {200}
