"""GET /v1/tinker/sessions, on Postgres and on the embedded SQLite: each of the project's Tinker
sessions with its state (live, finished, expired) and its training clients (base model, LoRA
rank, status, last saved state, the calls they applied), newest first in pages of a bounded
size; a key's or a cookie's project only, rate limited like every /v1 route."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from app.core.clock import utcnow
from app.core.tinker_tables import TinkerModel, TinkerSession
from app.tinker.presenters import MODELS_PER_SESSION
from tests.app.tinker.activity import (
    first_request,
    forward_backward,
    named_session,
    save_state,
    settle,
    tinker_of,
)
from tests.app.tinker.test_tinker_api import edit
from tests.conftest import Api


def listed(api: Api, **params: Any) -> dict[str, Any]:
    answer = api.client.get("/v1/tinker/sessions", headers=api.headers, params=params)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_a_session_is_listed_with_its_training_clients_and_their_calls(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    tinker = tinker_of(api)
    session_id = named_session(tinker, "sl-run")
    model_id = tinker.model(session_id)
    settle(api.settings, first_request(api.settings, model_id), "done")
    settle(api.settings, forward_backward(tinker, model_id, 1, forward_only=False), "done")
    settle(api.settings, forward_backward(tinker, model_id, 2, forward_only=False), "done")
    settle(api.settings, tinker.optim(model_id, 3).json()["request_id"], "failed")
    settle(api.settings, save_state(tinker, model_id, 4, "step-1"), "done")
    tinker.optim(model_id, 5)  # waiting for the worker
    saved = f"tinker://{model_id}/weights/step-1"
    edit(api.settings, TinkerModel, model_id, status="ready", last_saved_path=saved)

    body = listed(api)
    assert (body["object"], body["has_more"], body["next_after"]) == ("list", False, None)
    (session,) = body["data"]
    assert {k: session[k] for k in ("id", "display_name", "tags", "sdk_version")} == {
        "id": session_id,
        "display_name": "sl-run",
        "tags": ["t1"],
        "sdk_version": "0.38.0",
    }
    assert (session["status"], session["live"], session["finished_at"]) == ("live", True, None)
    assert session["created_at"] <= session["heartbeat_at"]
    assert session["model_count"] == 1
    (model,) = session["models"]
    assert {k: v for k, v in model.items() if k not in ("created_at", "last_request_at")} == {
        "object": "tinker.training_client",
        "id": model_id,
        "base_model": "tiny-random-llama",
        "lora_rank": 4,
        "status": "ready",
        "live": True,
        "last_saved_path": saved,
        "error_message": None,
        "calls_applied": 4,
        "calls_failed": 1,
        "calls_queued": 1,
        "applied_by_kind": {"create_model": 1, "forward_backward": 2, "save_weights": 1},
    }


def test_ended_sessions_say_how_they_ended(make_api: Callable[..., Api]) -> None:
    api = make_api()
    tinker = tinker_of(api)
    finished = tinker.session()
    assert (
        tinker.post(f"sessions/{finished}/finish", {"reason": {"type": "success"}}).status_code
        == 200
    )
    expired = tinker.session()
    model_id = tinker.model(expired)
    stale = utcnow() - timedelta(seconds=api.settings.tinker_session_ttl_s + 60)
    edit(api.settings, TinkerSession, expired, heartbeat_at=stale)
    edit(api.settings, TinkerModel, model_id, status="failed", error_message="worker lost")

    states = {s["id"]: s for s in listed(api)["data"]}
    assert (states[finished]["status"], states[finished]["live"]) == ("finished", False)
    assert states[finished]["finish_reason"] == "success"
    assert states[finished]["finished_at"] is not None
    assert (states[expired]["status"], states[expired]["live"]) == ("expired", False)
    (model,) = states[expired]["models"]
    assert (model["status"], model["live"], model["error_message"]) == (
        "failed",
        False,
        "worker lost",
    )


def test_pages_are_newest_first_bounded_and_cover_every_session_once(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    tinker = tinker_of(api)
    made = [tinker.session() for _ in range(5)]
    first = listed(api, limit=2)
    assert [s["id"] for s in first["data"]] == made[:-3:-1]
    assert first["has_more"] and first["next_after"] == made[-2]
    second = listed(api, limit=2, after=first["next_after"])
    assert [s["id"] for s in second["data"]] == [made[2], made[1]]
    last = listed(api, limit=2, after=second["next_after"])
    assert [s["id"] for s in last["data"]] == [made[0]]
    assert (last["has_more"], last["next_after"]) == (False, None)

    # Sessions made in the same instant still come once each, across pages.
    same = utcnow() - timedelta(minutes=1)
    for session_id in made:
        edit(api.settings, TinkerSession, session_id, created_at=same)
    seen: list[str] = []
    after = None
    while True:
        page = listed(api, limit=2, **({"after": after} if after else {}))
        seen += [s["id"] for s in page["data"]]
        if not page["has_more"]:
            break
        after = page["next_after"]
    assert sorted(seen) == sorted(made) and len(seen) == len(made)

    for limit in (0, 101):
        answer = api.client.get("/v1/tinker/sessions", headers=api.headers, params={"limit": limit})
        assert answer.status_code == 422
    assert len(listed(api, limit=100)["data"]) == 5


def test_a_session_lists_its_newest_training_clients_and_counts_them_all(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    tinker = tinker_of(api)
    session_id = tinker.session()
    total = MODELS_PER_SESSION + 2
    start = utcnow() - timedelta(hours=1)
    for n in range(total):
        model_id = tinker.model(session_id, n)
        # Ended at once (the project may hold two live ones), each a minute after the last.
        edit(api.settings, TinkerModel, model_id, status="closed",
             created_at=start + timedelta(minutes=n))  # fmt: skip
    (session,) = listed(api)["data"]
    assert session["model_count"] == total
    assert [m["id"] for m in session["models"]] == [
        f"{session_id}:train:{n}" for n in range(2, total)
    ]


def test_only_the_callers_project_is_listed(make_api: Callable[..., Api]) -> None:
    api = make_api()
    mine = tinker_of(api).session()
    theirs_api = Api(api.client, api.settings, *api.new_key())
    theirs = tinker_of(theirs_api)
    their_session = theirs.session()
    theirs.model(their_session)

    assert [s["id"] for s in listed(api)["data"]] == [mine]
    assert [s["id"] for s in listed(theirs_api)["data"]] == [their_session]
    foreign_cursor = api.client.get(
        "/v1/tinker/sessions", headers=api.headers, params={"after": their_session}
    )
    assert foreign_cursor.status_code == 404
    assert api.client.get("/v1/tinker/sessions").status_code == 401
    # The Tinker key is for /api/v1; /v1 takes the project key (or the dashboard's cookie).
    tml = api.client.get("/v1/tinker/sessions", headers={"X-API-Key": "tml-" + api.key})
    assert tml.status_code == 401


def test_the_dashboards_cookie_lists_its_project_and_the_route_is_rate_limited(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(rate_limit_per_minute=1, rate_limit_burst=3)
    session_id = tinker_of(api).session()  # one request of the key's budget
    signed_in = api.client.post(
        "/v1/session", json={"key": api.key}, headers={"X-Requested-With": "test"}
    )
    assert signed_in.status_code == 200, signed_in.text  # a second
    by_cookie = api.client.get("/v1/tinker/sessions")  # a third
    assert by_cookie.status_code == 200
    assert [s["id"] for s in by_cookie.json()["data"]] == [session_id]
    assert api.client.get("/v1/tinker/sessions").status_code == 429
