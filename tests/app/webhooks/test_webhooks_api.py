"""/v1/webhooks: endpoints (secret shown once, bounded, URL confined), the outbox rows that job
status changes write, the delivery log and redelivery, and project isolation."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Callable
from typing import Any

import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.webhooks import urls as webhook_urls
from tests.conftest import Api, tiny_spec

EVENTS = ["job.succeeded", "job.failed"]


def _error(response: Any, status: int = 422) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def _create(api: Api, url: str = "http://127.0.0.1:9/hook", **body: Any) -> Any:
    return api.client.post(
        "/v1/webhooks", json={"url": url, "events": EVENTS, **body}, headers=api.headers
    )


@pytest.fixture
def open_api(make_api: Callable[..., Api]) -> Api:
    """The API with private webhook addresses allowed (the receivers in tests are local)."""
    return make_api(webhook_allow_private=True, max_webhooks_per_project=3)


def test_create_shows_the_secret_once_then_list_get_delete(open_api: Api) -> None:
    api = open_api
    created = _create(api, description="ci notifications")
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["secret"].startswith("whsec_")
    assert len(base64.b64decode(body["secret"].removeprefix("whsec_"))) >= 24
    assert body["events"] == EVENTS and body["description"] == "ci notifications"

    got = api.client.get(f"/v1/webhooks/{body['id']}", headers=api.headers).json()
    assert "secret" not in got
    assert got["url"] == "http://127.0.0.1:9/hook"
    listed = api.client.get("/v1/webhooks", headers=api.headers).json()
    assert [w["id"] for w in listed["data"]] == [body["id"]]
    assert all("secret" not in w for w in listed["data"])

    assert api.client.delete(f"/v1/webhooks/{body['id']}", headers=api.headers).status_code == 204
    assert api.client.get(f"/v1/webhooks/{body['id']}", headers=api.headers).status_code == 404
    assert api.client.get("/v1/webhooks", headers=api.headers).json()["data"] == []


def test_list_pages_with_a_cursor(open_api: Api) -> None:
    api = open_api
    ids = [_create(api).json()["id"] for _ in range(3)]
    first = api.client.get("/v1/webhooks?limit=2", headers=api.headers).json()
    assert [w["id"] for w in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = api.client.get(
        f"/v1/webhooks?limit=2&after={first['next_after']}", headers=api.headers
    ).json()
    assert [w["id"] for w in rest["data"]] == [ids[0]] and not rest["has_more"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "ftp://127.0.0.1/x"}, "url"),
        ({"url": "file:///etc/passwd"}, "url"),
        ({"url": "http://"}, "url"),
        ({"url": "http://user:pw@127.0.0.1/x"}, "url"),
        ({"url": "http://127.0.0.1/" + "a" * 2048}, "url"),
        ({"events": []}, "events"),
        ({"events": ["job.exploded"]}, "events"),
        ({"description": "d" * 501}, "description"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_input_is_a_422_naming_the_field(
    open_api: Api, body: dict[str, Any], param: str
) -> None:
    payload = {"url": "http://127.0.0.1:9/hook", "events": EVENTS, **body}
    response = open_api.client.post("/v1/webhooks", json=payload, headers=open_api.headers)
    assert _error(response)["param"].startswith(param)


def test_endpoints_per_project_are_bounded(open_api: Api) -> None:
    for _ in range(3):
        assert _create(open_api).status_code == 201
    error = _error(_create(open_api))
    assert error["param"] == "url" and "at most 3" in error["message"]


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/hook",
        "http://localhost/hook",
        "http://10.1.2.3/hook",
        "http://192.168.0.10/hook",
        "https://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://0.0.0.0/hook",
        "http://100.64.0.1/hook",
        # IPv6 forms that carry a private IPv4 address (all accepted before)
        "http://[2002:7f00:1::]/hook",  # 6to4 of 127.0.0.1
        "http://[2002:a9fe:a9fe::1]/latest/meta-data",  # 6to4 of 169.254.169.254
        "http://[2002:a00:1::]/hook",  # 6to4 of 10.0.0.1
        "http://[2002:c0a8:1::]/hook",  # 6to4 of 192.168.0.1
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/hook",  # Teredo, client 127.0.0.1
        "http://[64:ff9b::7f00:1]/hook",  # NAT64 of 127.0.0.1
        "http://[64:ff9b::a9fe:a9fe]/hook",  # NAT64 of 169.254.169.254
        "http://[64:ff9b:1::a00:1]/hook",  # local-use NAT64
        "http://[::7f00:1]/hook",  # IPv4-compatible 127.0.0.1
        "http://[::ffff:0:a00:1]/hook",  # IPv4-translated 10.0.0.1
        "http://[fc00::1]/hook",  # unique local
        "http://[fe80::1]/hook",  # link-local
    ],
)
def test_private_addresses_are_refused_unless_allowed(
    make_api: Callable[..., Api], url: str
) -> None:
    strict = make_api(webhook_allow_private=False)
    error = _error(_create(strict, url))
    assert error["param"] == "url"
    assert strict.client.get("/v1/webhooks", headers=strict.headers).json()["data"] == []


def test_another_project_sees_nothing(open_api: Api) -> None:
    api = open_api
    hook = _create(api).json()["id"]
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    for method, path in [
        ("GET", f"/v1/webhooks/{hook}"),
        ("DELETE", f"/v1/webhooks/{hook}"),
        ("GET", f"/v1/webhooks/{hook}/deliveries"),
        ("POST", f"/v1/webhooks/{hook}/deliveries/msg_x/redeliver"),
    ]:
        response = api.client.request(method, path, headers=other)
        assert _error(response, 404)["param"] == "webhook_id"
    assert api.client.get("/v1/webhooks", headers=other).json()["data"] == []
    assert api.client.get(f"/v1/webhooks/{hook}", headers=api.headers).status_code == 200


def _finish(api: Api, job_id: str, target: JobStatus) -> None:
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            attempt = transitions.claim(session, job_id, "test-worker")
        with session_scope(make_session_factory(engine)) as session:
            transitions.transition(
                session, job_id, target, attempt=attempt, error_code="boom", message="it broke"
            )
    finally:
        engine.dispose()


def test_a_jobs_status_changes_are_queued_and_listed(open_api: Api) -> None:
    api = open_api
    hook = _create(api, events=["job.running", "job.failed", "job.cancelled"]).json()["id"]
    only_succeeded = _create(api, events=["job.succeeded"]).json()["id"]
    jobs = [api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers) for _ in range(2)]
    job_id, other_job = (j.json()["id"] for j in jobs)
    _finish(api, job_id, JobStatus.FAILED)
    api.client.post(f"/v1/jobs/{other_job}/cancel", headers=api.headers)

    url = f"/v1/webhooks/{hook}/deliveries"
    listed = api.client.get(f"{url}?job_id={job_id}", headers=api.headers).json()
    assert [d["event_type"] for d in listed["data"]] == ["job.failed", "job.running"]
    failed = listed["data"][0]
    assert failed["state"] == "pending" and failed["attempts"] == 0
    assert failed["attempt_log"] == []
    assert failed["payload"]["type"] == "job.failed"
    assert failed["payload"]["data"]["job_id"] == job_id
    assert failed["payload"]["data"]["error"] == {"code": "boom", "message": "it broke"}
    everything = api.client.get(url, headers=api.headers).json()
    assert {(d["job_id"], d["event_type"]) for d in everything["data"]} == {
        (job_id, "job.running"),
        (job_id, "job.failed"),
        (other_job, "job.cancelled"),
    }
    page = api.client.get(f"{url}?limit=2", headers=api.headers).json()
    assert page["has_more"] and len(page["data"]) == 2
    rest = api.client.get(f"{url}?limit=2&after={page['next_after']}", headers=api.headers).json()
    assert [d["id"] for d in page["data"] + rest["data"]] == [d["id"] for d in everything["data"]]
    # Nothing for the endpoint that only wanted job.succeeded.
    none = api.client.get(f"/v1/webhooks/{only_succeeded}/deliveries", headers=api.headers)
    assert none.json()["data"] == []


def test_redeliver_requeues_with_the_same_id(open_api: Api) -> None:
    api = open_api
    hook = _create(api, events=["job.cancelled"]).json()["id"]
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers)
    [delivery] = api.client.get(f"/v1/webhooks/{hook}/deliveries", headers=api.headers).json()[
        "data"
    ]
    response = api.client.post(
        f"/v1/webhooks/{hook}/deliveries/{delivery['id']}/redeliver", headers=api.headers
    )
    assert response.status_code == 202, response.text
    again = response.json()
    assert again["id"] == delivery["id"] and again["state"] == "pending"
    assert again["next_attempt_at"] is not None
    missing = api.client.post(
        f"/v1/webhooks/{hook}/deliveries/msg_nope/redeliver", headers=api.headers
    )
    assert _error(missing, 404)["param"] == "delivery_id"


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("2606:4700:4700::1111", True),
        ("2002:808:808::", True),  # 6to4 of 8.8.8.8
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("::ffff:8.8.8.8", True),
        ("2002:7f00:1::", False),
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", False),  # Teredo's client is 127.0.0.1
        ("::", False),
        ("ff02::1", False),
        ("2001:db8::1", False),
    ],
)
def test_ipv6_is_judged_by_the_ipv4_it_carries(address: str, public: bool) -> None:
    assert webhook_urls.is_public(ipaddress.ip_address(address)) is public
