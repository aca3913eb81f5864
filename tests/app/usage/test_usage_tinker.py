"""GET /v1/usage's `tinker` part, on Postgres and on the embedded SQLite: the sessions, training
clients and calls (per kind, with what became of them) a project made over the last
`tinker_days` days, and its sessions and training clients live now against their limits. The
activity is made through the Tinker API's own paths (tests.app.tinker.activity); no other
project's ever counts."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from app.core.clock import utcnow
from tests.app.tinker.activity import (
    backdate,
    first_request,
    forward_backward,
    sampler_and_sample,
    save_state,
    settle,
    tinker_of,
)
from tests.conftest import Api


def tinker_usage(api: Api, **params: int) -> dict[str, Any]:
    answer = api.client.get("/v1/usage", headers=api.headers, params=params)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()["tinker"]
    return body


def calls_of(usage: dict[str, Any]) -> dict[str, tuple[int, int, int, int]]:
    """kind -> (requests, applied, failed, queued)."""
    return {
        c["kind"]: (c["requests"], c["applied"], c["failed"], c["queued"]) for c in usage["calls"]
    }


def test_a_project_without_tinker_activity_shows_zeros_and_its_limits(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(tinker_max_sessions_per_project=5, tinker_max_models_per_project=3)
    usage = tinker_usage(api)
    today = utcnow().date()
    assert usage == {
        "days": 7,
        "since": (today - timedelta(days=6)).isoformat(),
        "sessions_created": 0,
        "models_created": 0,
        "calls": [],
        "live_sessions": 0,
        "limit_sessions": 5,
        "live_models": 0,
        "limit_models": 3,
        "stored_bytes": 0,
        "limit_stored_bytes": api.settings.tinker_max_stored_bytes_per_project,
    }
    assert tinker_usage(api, tinker_days=1)["since"] == today.isoformat()


def test_sessions_models_and_calls_by_kind_are_counted_with_their_outcomes(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    tinker = tinker_of(api)
    session_id = tinker.session()
    model_id = tinker.model(session_id)
    settle(api.settings, first_request(api.settings, model_id), "done")
    settle(api.settings, forward_backward(tinker, model_id, 1, forward_only=False), "done")
    settle(api.settings, forward_backward(tinker, model_id, 2, forward_only=False), "failed")
    forward_backward(tinker, model_id, 3, forward_only=True)  # still queued
    settle(api.settings, tinker.optim(model_id, 4).json()["request_id"], "done")
    settle(api.settings, save_state(tinker, model_id, 5, "step-1"), "done")
    for_sampler, sample = sampler_and_sample(tinker, model_id, 6)
    settle(api.settings, for_sampler, "done")
    settle(api.settings, sample, "done")
    closed = tinker.session()
    assert (
        tinker.post(f"sessions/{closed}/finish", {"reason": {"type": "success"}}).status_code == 200
    )

    usage = tinker_usage(api)
    assert usage["sessions_created"] == 2
    assert usage["models_created"] == 1
    assert calls_of(usage) == {
        "create_model": (1, 1, 0, 0),
        "forward": (1, 0, 0, 1),
        "forward_backward": (2, 1, 1, 0),
        "optim_step": (1, 1, 0, 0),
        "sample": (1, 1, 0, 0),
        "save_weights": (1, 1, 0, 0),
        "save_weights_for_sampler": (1, 1, 0, 0),
    }
    assert [c["kind"] for c in usage["calls"]] == sorted(calls_of(usage))
    # The finished session is not live; the training client (not ended) is.
    assert (usage["live_sessions"], usage["live_models"]) == (1, 1)


def test_only_the_period_asked_for_is_counted_and_live_counts_are_now(
    make_api: Callable[..., Api],
) -> None:
    api = make_api()
    tinker = tinker_of(api)
    old = tinker.session()
    old_model = tinker.model(old)
    tinker.optim(old_model, 1)
    backdate(api.settings, utcnow() - timedelta(days=10), session_id=old)
    recent = tinker.session()
    tinker.optim(tinker.model(recent), 1)

    week = tinker_usage(api)
    assert (week["sessions_created"], week["models_created"]) == (1, 1)
    assert calls_of(week) == {"create_model": (1, 0, 0, 1), "optim_step": (1, 0, 0, 1)}
    month = tinker_usage(api, tinker_days=30)
    assert (month["days"], month["sessions_created"], month["models_created"]) == (30, 2, 2)
    assert calls_of(month) == {"create_model": (2, 0, 0, 2), "optim_step": (2, 0, 0, 2)}
    # Live counts do not depend on the period: the backdated session's heartbeat is stale,
    # both training clients still hold their place in the quota.
    for usage in (week, month):
        assert (usage["live_sessions"], usage["live_models"]) == (1, 2)


def test_another_projects_tinker_activity_never_shows(make_api: Callable[..., Api]) -> None:
    api = make_api()
    theirs = Api(api.client, api.settings, *api.new_key())
    other = tinker_of(theirs)
    model_id = other.model(other.session())
    settle(api.settings, other.optim(model_id, 1).json()["request_id"], "done")

    mine = tinker_usage(api, tinker_days=90)
    assert (mine["sessions_created"], mine["models_created"], mine["calls"]) == (0, 0, [])
    assert (mine["live_sessions"], mine["live_models"]) == (0, 0)
    their_usage = tinker_usage(theirs)
    assert (their_usage["sessions_created"], their_usage["live_models"]) == (1, 1)
    assert calls_of(their_usage)["optim_step"] == (1, 1, 0, 0)


def test_tinker_days_is_bounded_and_the_schema_documents_the_part(api: Api) -> None:
    for days in (0, 91):
        answer = api.client.get("/v1/usage", headers=api.headers, params={"tinker_days": days})
        assert answer.status_code == 422
    schema = api.client.get("/openapi.json").json()
    assert "tinker" in schema["components"]["schemas"]["UsageOut"]["required"]
    part = schema["components"]["schemas"]["TinkerUsageOut"]
    assert "GRPO_TINKER_MAX_MODELS_PER_PROJECT" in part["properties"]["limit_models"]["description"]
    assert "Tokens are not counted" in part["properties"]["calls"]["description"]
    params = [p["name"] for p in schema["paths"]["/v1/usage"]["get"]["parameters"]]
    assert "tinker_days" in params
