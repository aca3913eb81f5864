"""The dashboard's sign-in (/v1/session): a key buys an HttpOnly, SameSite=Strict cookie holding
a signed, expiring token that names the key; the cookie is a second way to the same principal
as a Bearer key (project scoping, revocation), and a cookie-authenticated request that changes
state must carry X-Requested-With (no other site can add that header)."""

from __future__ import annotations

import time
from http.cookies import SimpleCookie
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import ApiKey
from app.core.session_tokens import SessionTokens, load_or_create_secret
from app.core.settings import build_settings
from app.main import create_app
from app.sessions.service import KEY_CACHE_TTL_S
from tests.conftest import Api, tiny_spec, wait_until

CSRF = {"X-Requested-With": "test"}


def _sign_in(client: TestClient, key: str) -> dict[str, object]:
    response = client.post("/v1/session", json={"key": key}, headers=CSRF)
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def _set_cookie(response: object) -> SimpleCookie:
    cookie = SimpleCookie()
    cookie.load(response.headers["set-cookie"])  # type: ignore[attr-defined]
    return cookie


def _revoke(api: Api, key: str) -> None:
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            session.execute(
                update(ApiKey).where(ApiKey.prefix == key.split("_")[1]).values(revoked_at=utcnow())
            )
    finally:
        engine.dispose()


def test_a_key_buys_an_httponly_strict_cookie_that_authenticates(api: Api) -> None:
    response = api.client.post("/v1/session", json={"key": api.key}, headers=CSRF)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["project_id"] == api.project_id and body["via"] == "cookie"
    morsel = _set_cookie(response)["grpo_session"]
    assert morsel["httponly"] is True
    assert morsel["samesite"].lower() == "strict"
    assert morsel["path"] == "/v1"
    assert int(morsel["max-age"]) == int(api.settings.session_ttl_hours * 3600)
    assert not morsel["secure"]  # plain http here: a Secure cookie would never come back
    assert api.key not in morsel.value  # the token names the key, it does not hold it

    # The cookie alone (no Authorization header) is the project's principal.
    me = api.client.get("/v1/session")
    assert me.status_code == 200, me.text
    assert me.json()["project_id"] == api.project_id and me.json()["via"] == "cookie"
    assert me.json()["expires_at"] == body["expires_at"]
    assert api.client.get("/v1/jobs").status_code == 200
    # The same endpoint with a Bearer key reports the key, not a session.
    bearer = TestClient(api.client.app).get("/v1/session", headers=api.headers)
    assert bearer.json()["via"] == "bearer" and bearer.json()["expires_at"] is None


def test_the_key_may_come_as_a_bearer_header(api: Api) -> None:
    response = api.client.post("/v1/session", headers={**api.headers, **CSRF})
    assert response.status_code == 200, response.text
    assert "grpo_session" in _set_cookie(response)


@pytest.mark.parametrize("key", ["not-a-key", "grpo_abc_def", ""])
def test_a_wrong_key_gets_401_and_no_cookie(api: Api, key: str) -> None:
    response = api.client.post("/v1/session", json={"key": key}, headers=CSRF)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert "set-cookie" not in response.headers
    assert api.client.post("/v1/session", json={}, headers=CSRF).status_code == 401


def test_sign_in_needs_the_csrf_header(api: Api) -> None:
    """Else another site could sign a visitor into the attacker's project (login CSRF)."""
    response = api.client.post("/v1/session", json={"key": api.key})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "csrf_header_required"
    assert response.json()["error"]["param"] == "X-Requested-With"
    assert "set-cookie" not in response.headers


def test_a_cookie_post_without_the_header_is_refused_and_changes_nothing(api: Api) -> None:
    _sign_in(api.client, api.key)
    spec = {**tiny_spec(), "name": "csrf-probe"}
    refused = api.client.post("/v1/jobs", json=spec)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_header_required"
    listed = api.client.get("/v1/jobs").json()["data"]
    assert [j for j in listed if j["name"] == "csrf-probe"] == []

    created = api.client.post("/v1/jobs", json=spec, headers=CSRF)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    assert api.client.post(f"/v1/jobs/{job_id}/cancel").status_code == 403
    assert api.client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    cancelled = api.client.post(f"/v1/jobs/{job_id}/cancel", headers=CSRF)
    assert cancelled.status_code == 200, cancelled.text
    assert api.client.delete(f"/v1/jobs/{job_id}").status_code == 403
    # The published schema says so (it did not: only /v1/session listed the 403).
    paths = api.client.get("/openapi.json").json()["paths"]
    for path, method in (("/v1/jobs", "post"), ("/v1/jobs/{job_id}/cancel", "post")):
        assert "403" in paths[path][method]["responses"], (method, path)

    # Bearer requests are unaffected: no header needed (a fresh client, no cookie).
    bearer = TestClient(api.client.app).post("/v1/jobs", json=spec, headers=api.headers)
    assert bearer.status_code == 201, bearer.text


def test_a_cookie_sees_only_its_own_project(api: Api) -> None:
    other_key, other_project = api.new_key()
    theirs = TestClient(api.client.app).post(
        "/v1/jobs",
        json={**tiny_spec(), "name": "theirs"},
        headers={"Authorization": f"Bearer {other_key}"},
    )
    assert theirs.status_code == 201
    _sign_in(api.client, api.key)
    ours = api.client.post("/v1/jobs", json={**tiny_spec(), "name": "ours"}, headers=CSRF)
    assert ours.status_code == 201

    ids = {j["id"] for j in api.client.get("/v1/jobs", params={"limit": 100}).json()["data"]}
    assert ours.json()["id"] in ids and theirs.json()["id"] not in ids
    assert api.client.get(f"/v1/jobs/{theirs.json()['id']}").status_code == 404
    assert api.client.get(f"/v1/jobs/{theirs.json()['id']}/stream").status_code == 404
    # A Bearer key wins over the cookie: that request is the other project's.
    me = api.client.get("/v1/session", headers={"Authorization": f"Bearer {other_key}"})
    assert me.json()["project_id"] == other_project and me.json()["via"] == "bearer"


def test_an_expired_or_forged_token_is_refused(api: Api) -> None:
    key_id = _sign_in(api.client, api.key)["key_id"]
    assert isinstance(key_id, str)
    secret = load_or_create_secret(
        api.settings.resolved_session_secret_file, api.settings.session_secret
    )
    client = TestClient(api.client.app)

    expired, _ = SessionTokens(secret, ttl_s=60, clock=lambda: time.time() - 61).issue(key_id)
    client.cookies.set("grpo_session", expired, path="/v1")
    refused = client.get("/v1/jobs")
    assert refused.status_code == 401
    assert "expired" in refused.json()["error"]["message"]

    valid, _ = SessionTokens(secret, ttl_s=60).issue(key_id)
    client.cookies.set("grpo_session", valid, path="/v1")
    assert client.get("/v1/jobs").status_code == 200

    # Signed with another secret, the expiry pushed out or the issue time moved after signing:
    # refused.
    forged, _ = SessionTokens(b"x" * 32, ttl_s=60).issue(key_id)
    version, kid, issued, expires, signature = valid.split(".")
    stretched = f"{version}.{kid}.{issued}.{int(expires) + 10**6}.{signature}"
    reissued = f"{version}.{kid}.{int(issued) + 10**6}.{expires}.{signature}"
    for token in (forged, stretched, reissued, "garbage", "v2." + "a" * 500, "v2.a.b.c"):
        client.cookies.set("grpo_session", token, path="/v1")
        assert client.get("/v1/jobs").status_code == 401, token


def test_a_revoked_keys_session_stops_working(api: Api) -> None:
    key, project_id = api.new_key()
    _sign_in(api.client, key)
    assert api.client.get("/v1/session").json()["project_id"] == project_id
    _revoke(api, key)
    wait_until(
        lambda: api.client.get("/v1/jobs").status_code == 401,
        KEY_CACHE_TTL_S + 10,  # the key cache's TTL, as for Bearer keys, plus a margin
        "the revoked key's session to be refused",
    )
    assert api.client.post("/v1/session", json={"key": key}, headers=CSRF).status_code == 401


def test_sign_out_clears_the_cookie(api: Api) -> None:
    _sign_in(api.client, api.key)
    response = api.client.delete("/v1/session", headers=CSRF)
    assert response.status_code == 204
    morsel = _set_cookie(response)["grpo_session"]
    assert morsel.value == "" and int(morsel["max-age"]) == 0 and morsel["path"] == "/v1"
    assert api.client.get("/v1/session").status_code == 401


def _browser(api: Api, token: str) -> TestClient:
    client = TestClient(api.client.app)
    client.cookies.set("grpo_session", token, path="/v1")
    return client


def test_sign_out_ends_the_token_even_where_it_was_copied(api: Api) -> None:
    """A token taken from the browser (a shared machine, a stolen cookie) dies with the sign-out
    instead of living out its 12 hours; so does every other session of the key, and a new
    sign-in works at once."""
    key, _ = api.new_key()
    other_key, _ = api.new_key()
    _sign_in(api.client, key)
    token = api.client.cookies.get("grpo_session")
    assert token
    second_browser = TestClient(api.client.app)
    _sign_in(second_browser, key)
    other_keys_browser = TestClient(api.client.app)
    _sign_in(other_keys_browser, other_key)
    copied = _browser(api, token)
    assert copied.get("/v1/jobs").status_code == 200

    assert api.client.delete("/v1/session", headers=CSRF).status_code == 204

    refused = copied.get("/v1/jobs")
    assert refused.status_code == 401
    assert "signed out" in refused.json()["error"]["message"]
    assert second_browser.get("/v1/jobs").status_code == 401  # the key's sessions, all of them
    assert other_keys_browser.get("/v1/jobs").status_code == 200  # another key's: untouched
    # The key itself still works, and signs in again at once.
    assert api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    _sign_in(api.client, key)
    assert api.client.get("/v1/jobs").status_code == 200
    assert copied.get("/v1/jobs").status_code == 401  # the old token stays dead


def test_a_cookie_sign_out_without_the_csrf_header_is_refused(api: Api) -> None:
    """Another site can make the browser send the cookie with a DELETE, not the header."""
    _sign_in(api.client, api.key)
    refused = api.client.delete("/v1/session")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "csrf_header_required"
    assert "set-cookie" not in refused.headers  # the cookie is not cleared either
    assert api.client.get("/v1/jobs").status_code == 200  # and the session lives on


def test_a_sign_out_without_a_valid_cookie_ends_nothing(api: Api) -> None:
    key, _ = api.new_key()
    _sign_in(api.client, key)
    stranger = TestClient(api.client.app)
    assert stranger.delete("/v1/session", headers=CSRF).status_code == 204
    stranger.cookies.set("grpo_session", "v2.key_x.1.9999999999.forged", path="/v1")
    assert stranger.delete("/v1/session", headers=CSRF).status_code == 204
    assert api.client.get("/v1/jobs").status_code == 200


def test_a_first_version_token_is_accepted_until_a_sign_out(api: Api) -> None:
    """Tokens issued before this version (`v1.<key id>.<expiry>.<signature>`, no issue time)
    keep working after an upgrade, as issued before any sign-out."""
    key, _ = api.new_key()
    key_id = _sign_in(api.client, key)["key_id"]
    secret = load_or_create_secret(
        api.settings.resolved_session_secret_file, api.settings.session_secret
    )
    payload = f"v1.{key_id}.{int(time.time()) + 60}"
    signed = SessionTokens(secret, ttl_s=60)._sign(payload)
    first_version = _browser(api, f"{payload}.{signed}")
    assert first_version.get("/v1/jobs").status_code == 200

    assert api.client.delete("/v1/session", headers=CSRF).status_code == 204
    assert first_version.get("/v1/jobs").status_code == 401


def test_the_secret_persists_in_the_data_folder(tmp_path: Path) -> None:
    """Every API process on one data folder signs alike, and a restart signs nobody out."""
    settings = build_settings(data_dir=tmp_path)
    path = settings.resolved_session_secret_file
    assert path == tmp_path / "session-secret"
    first = load_or_create_secret(path, None)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_secret(path, None) == first and len(first) == 64
    assert load_or_create_secret(path, "y" * 40) == b"y" * 40


def test_an_unwritable_secret_file_stops_the_start_with_what_to_set(tmp_path: Path) -> None:
    """A read-only data folder (the compose file mounts the API's read-only): the API says to
    set GRPO_SESSION_SECRET or GRPO_SESSION_SECRET_FILE rather than start without a secret."""
    unwritable = tmp_path / "no-such-folder" / "session-secret"
    with pytest.raises(RuntimeError, match="GRPO_SESSION_SECRET"):
        create_app(build_settings(data_dir=tmp_path, session_secret_file=unwritable))
    configured = build_settings(
        data_dir=tmp_path, session_secret_file=unwritable, session_secret="z" * 32
    )
    with TestClient(create_app(configured)) as client:
        assert client.get("/v1/session").status_code == 401
    assert not unwritable.parent.exists()


def test_a_restarted_api_accepts_the_cookie_and_secure_can_be_forced(api: Api) -> None:
    _sign_in(api.client, api.key)
    token = api.client.cookies.get("grpo_session")
    assert token
    with TestClient(create_app(api.settings)) as restarted:
        restarted.cookies.set("grpo_session", token, path="/v1")
        assert restarted.get("/v1/session").status_code == 200
    forced = build_settings(**{**api.settings.model_dump(), "session_cookie_secure": True})
    with TestClient(create_app(forced)) as secure:
        response = secure.post("/v1/session", json={"key": api.key}, headers=CSRF)
        assert response.status_code == 200
        assert _set_cookie(response)["grpo_session"]["secure"] is True
