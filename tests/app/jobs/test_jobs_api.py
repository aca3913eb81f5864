"""The job endpoints, on real Postgres+Redis and on the embedded default."""

from __future__ import annotations

import copy

from tests.conftest import Api, tiny_spec


def create(api: Api, spec: dict[str, object] | None = None, **headers: str) -> dict[str, object]:
    response = api.client.post("/v1/jobs", json=spec or tiny_spec(), headers=api.headers | headers)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_create_returns_queued_job_with_resolved_spec(api: Api) -> None:
    job = create(api)
    assert job["status"] == "queued"
    assert job["attempt"] == 0
    spec = job["spec"]
    assert isinstance(spec, dict)
    # defaults are filled in
    assert spec["grpo"]["kl"] == {
        "estimator": "k3_unbiased",
        "beta": 0.0,
        "placement": "loss",
        "flat_groups": "skip",
    }
    assert spec["grpo"]["eps_high"] == 0.28
    assert job["progress"]["total_steps"] == 2
    got = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers)
    assert got.status_code == 200
    assert got.json()["id"] == job["id"]


def test_create_writes_a_created_event(api: Api) -> None:
    job = create(api)
    events = api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.headers).json()
    assert [e["type"] for e in events["data"]][:1] == ["created"]
    assert events["has_more"] is False


def test_bad_spec_is_422_naming_the_field_path(api: Api) -> None:
    cases = {
        "grpo.kl.estimator": ("grpo", {"kl": {"estimator": "k4"}}),
        "grpo.group_size": ("grpo", {"group_size": 1}),
        "grpo.learnin_rate": ("grpo", {"learnin_rate": 0.1}),
        "graders[0].pattern": ("graders", [{"type": "regex", "pattern": "("}]),
        "graders[0].type": ("graders", [{"type": "telepathy"}]),
        "dataset": ("dataset", {"rows": [{"prompt": "x"}], "generator": {"type": "arithmetic"}}),
        "model": ("model", "gpt-7"),
    }
    for path, (key, value) in cases.items():
        spec = copy.deepcopy(tiny_spec())
        if key == "grpo":
            spec["grpo"] = {**spec["grpo"], **value}  # type: ignore[dict-item]
        else:
            spec[key] = value
        response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
        assert response.status_code == 422, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == path, (path, error)
        assert error["message"]


def test_unknown_top_level_field_and_non_json_are_422(api: Api) -> None:
    spec = tiny_spec() | {"colour": "blue"}
    response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "colour"
    raw = api.client.post(
        "/v1/jobs", content=b"{not json", headers=api.headers | {"content-type": "application/json"}
    )
    assert raw.status_code == 422
    assert raw.json()["error"]["type"] == "invalid_request_error"


def test_authentication_is_required(api: Api) -> None:
    assert api.client.get("/v1/jobs").status_code == 401
    bad = api.client.get("/v1/jobs", headers={"Authorization": "Bearer grpo_nope_nope"})
    assert bad.status_code == 401
    assert bad.json()["error"]["type"] == "authentication_error"
    wrong_secret = api.key.rsplit("_", 1)[0] + "_" + "x" * 43
    assert (
        api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {wrong_secret}"}).status_code
        == 401
    )


def test_unknown_and_cross_project_jobs_are_404(api: Api) -> None:
    job = create(api)
    assert api.client.get("/v1/jobs/job_doesnotexist", headers=api.headers).status_code == 404
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    for method, path in [
        ("GET", f"/v1/jobs/{job['id']}"),
        ("POST", f"/v1/jobs/{job['id']}/cancel"),
        ("GET", f"/v1/jobs/{job['id']}/events"),
    ]:
        response = api.client.request(method, path, headers=other)
        assert response.status_code == 404, (method, path)
        assert response.json()["error"]["type"] == "not_found"
    listed = api.client.get("/v1/jobs", headers=other).json()
    assert all(j["id"] != job["id"] for j in listed["data"])


def test_list_paginates_with_cursor_and_filters_by_status(api: Api) -> None:
    key, _ = api.new_key()
    headers = {"Authorization": f"Bearer {key}"}
    ids = []
    for _ in range(5):
        response = api.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
        ids.append(response.json()["id"])
    api.client.post(f"/v1/jobs/{ids[0]}/cancel", headers=headers)
    seen: list[str] = []
    after = None
    while True:
        params: dict[str, str | int] = {"limit": 2}
        if after:
            params["after"] = after
        page = api.client.get("/v1/jobs", params=params, headers=headers).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            assert page["next_after"] is None
            break
        after = page["next_after"]
    assert seen == list(reversed(ids))  # newest first, each exactly once
    cancelled = api.client.get("/v1/jobs", params={"status": "cancelled"}, headers=headers).json()
    assert [j["id"] for j in cancelled["data"]] == [ids[0]]
    queued = api.client.get(
        "/v1/jobs", params=[("status", "queued"), ("status", "running")], headers=headers
    ).json()
    assert len(queued["data"]) == 4
    bad = api.client.get("/v1/jobs", params={"status": "sleeping"}, headers=headers)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "status[0]"
    assert api.client.get("/v1/jobs", params={"limit": 0}, headers=headers).status_code == 422


def test_cancel_queued_job_is_immediate_and_idempotent(api: Api) -> None:
    job = create(api)
    first = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers)
    assert first.status_code == 200 and first.json()["status"] == "cancelled"
    assert first.json()["finished_at"] is not None
    second = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers)
    assert second.status_code == 200 and second.json()["status"] == "cancelled"
    events = api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.headers).json()["data"]
    assert [e["type"] for e in events] == ["created", "status"]
    assert events[1]["data"]["to"] == "cancelled"


def test_events_cursor(api: Api) -> None:
    job = create(api)
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.headers)
    page1 = api.client.get(f"/v1/jobs/{job['id']}/events?limit=1", headers=api.headers).json()
    assert page1["has_more"] is True and len(page1["data"]) == 1
    page2 = api.client.get(
        f"/v1/jobs/{job['id']}/events", params={"after": page1["next_after"]}, headers=api.headers
    ).json()
    assert page2["has_more"] is False
    assert [e["id"] for e in page2["data"]] > [e["id"] for e in page1["data"]]


def test_validate_resolves_defaults_and_warns(api: Api) -> None:
    spec = tiny_spec(kl={"estimator": "k1", "beta": 0.1})
    response = api.client.post("/v1/jobs/validate", json=spec, headers=api.headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["valid"] is True
    assert body["spec"]["grpo"]["kl"]["placement"] == "loss"
    assert body["spec"]["seed"] == 0
    assert body["dataset_rows"] == 16
    assert any("k1" in w for w in body["warnings"])
    # a dry run creates nothing
    listed = api.client.get("/v1/jobs", headers=api.headers).json()
    assert listed["data"] == []
    bad = api.client.post("/v1/jobs/validate", json=tiny_spec(steps=0), headers=api.headers)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "grpo.steps"


def test_oversized_body_is_413(api: Api) -> None:
    limit = api.settings.max_body_bytes
    rows = [{"prompt": "x" * 1000, "answer": "1"} for _ in range(limit // 1000 + 10)]
    spec = tiny_spec() | {"dataset": {"rows": rows}}
    response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert response.status_code == 413
    # Refused from Content-Length by the middleware, in the one error shape (it had no `code`).
    assert response.json()["error"]["type"] == "payload_too_large"
    assert response.json()["error"]["code"] == "payload_too_large"

    def chunks():  # no Content-Length: counted while streaming
        yield b'{"model": "tiny-random-llama", "x": "'
        for _ in range(limit // 4096 + 2):
            yield b"y" * 4096
        yield b'"}'

    streamed = api.client.post(
        "/v1/jobs", content=chunks(), headers=api.headers | {"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert streamed.json()["error"]["type"] == "payload_too_large"
    assert streamed.json()["error"]["code"] == "payload_too_large"
