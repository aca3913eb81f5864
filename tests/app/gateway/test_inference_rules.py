"""The gateway's rules without an engine: request bounds and malformed bodies (400 naming the
param, before anything is routed), names the project cannot use (404), the routing choice and
the EnsureRequest each kind of model needs, 503 + Retry-After when no process serves the base
or the process says it is busy, usage upserts on both databases, the daily quota (429
`insufficient_quota`) and GET /v1/usage. The inference process is ControlDouble
(tests/app/gateway_doubles.py); the real engine's tests are test_inference_gateway.py."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import InferenceServer
from app.gateway import quota, routing
from app.gateway import usage_repository as usage_repo
from app.gateway.protocol import Busy, EnsureRequest, WeightsRef
from tests.app.gateway.test_models_catalogue import _ft, _job, _train
from tests.app.gateway_doubles import ControlDouble, Registry, serve_control
from tests.conftest import Api, free_port, new_project_key, settings_for, wait_until
from tests.live_server import serve

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _hub_model() -> str:
    """A base model name no other test routes (a Hub repo id a job may name)."""
    return f"gateway-test/base-{secrets.token_hex(4)}"


def _chat(model: str = "tiny-random-llama", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def _error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture
def registry(api: Api) -> Iterator[Registry]:
    reg = Registry(api.settings)
    yield reg
    reg.close()


@pytest.fixture
def control() -> Iterator[ControlDouble]:
    with serve_control(ControlDouble(base_url="http://127.0.0.1:1", served_model="x")) as double:
        yield double


# ---------------------------------------------------------------- bounds and malformed bodies


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, _chat(max_tokens=5000), "max_tokens"),
        (CHAT, _chat(max_completion_tokens=5000), "max_completion_tokens"),
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 4097}, "max_tokens"),
        (CHAT, _chat(n=17), "n"),
        (COMPLETIONS, {"model": "m", "prompt": ["a"] * 5, "n": 4}, "n"),
        (CHAT, {"model": "m", "messages": []}, "messages"),
        (CHAT, {"model": "m", "messages": "hi"}, "messages"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
        ),
        (CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": "a\x00b"}]}, None),
        (
            CHAT,
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}],
            },
            None,
        ),
        (COMPLETIONS, {"model": "m", "prompt": "a\x00"}, "prompt"),
        (CHAT, _chat(stop=["ok", "a\x00"]), None),
        (CHAT, _chat(model="a\x00b"), "model"),
        (CHAT, _chat(tools=[]), "tools"),
        (CHAT, _chat(temperature=3), "temperature"),
        (CHAT, _chat(stream_options={"include_usage": True}), "stream_options"),
        (CHAT, _chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (
            CHAT,
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"description": "\x00"}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    ],
)
def test_bad_input_is_a_400_naming_the_param(
    api: Api, path: str, body: dict[str, Any], param: str | None
) -> None:
    error = _error(api.client.post(path, json=body, headers=api.headers), 400)
    assert error["type"] == "invalid_request_error", error
    if param is None:  # NUL in a nested string: named down to the field holding it
        assert error["param"] and "NUL" in error["message"], error
    else:
        assert error["param"] == param or error["param"].startswith(param), error


def test_prompt_size_is_bounded(make_api: Callable[..., Api]) -> None:
    api = make_api(inference_max_prompt_chars=10)
    body = _chat(messages=[{"role": "user", "content": "x" * 6}] * 2)
    error = _error(api.client.post(CHAT, json=body, headers=api.headers), 400, "messages")
    assert "GRPO_INFERENCE_MAX_PROMPT_CHARS" in error["message"]
    body2 = {"model": "m", "prompt": [1] * 11}
    _error(api.client.post(COMPLETIONS, json=body2, headers=api.headers), 400, "prompt")


def test_names_the_project_cannot_use_are_404(api: Api) -> None:
    other_key, _ = api.new_key()
    theirs = api.client.post(
        "/v1/jobs", json=_spec_of(_hub_model()), headers={"Authorization": f"Bearer {other_key}"}
    ).json()["id"]
    _train(api.settings, theirs, [1], succeed=True)
    for name in (_ft(theirs, model=_spec_model(api, theirs, other_key)), theirs, "nope", "job_x@1"):
        error = _error(api.client.post(CHAT, json=_chat(model=name), headers=api.headers), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model", error


def _spec_of(model: str) -> dict[str, Any]:
    from tests.conftest import tiny_spec

    return {**tiny_spec(), "model": model}


def _spec_model(api: Api, job_id: str, key: str) -> str:
    job = api.client.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
    return str(job.json()["spec"]["model"])


# ---------------------------------------------------------------- routing


def _server(server_id: str, bases: list[str], engines: list[dict[str, Any]]) -> InferenceServer:
    return InferenceServer(
        id=server_id,
        control_url=f"http://{server_id}",
        bases=bases,
        state={
            "engines": engines,
            "memory_budget_bytes": 1,
            "memory_used_bytes": 0,
            "max_adapters_per_engine": 4,
        },
    )


def _engine(key: str, running: int = 0, adapters: list[str] | None = None) -> dict[str, Any]:
    return {
        "key": key,
        "base_url": "http://e",
        "status": "ready",
        "adapters": adapters or [],
        "memory_bytes": 1,
        "running_requests": running,
    }


def test_routing_prefers_warm_weights_then_the_least_loaded() -> None:
    adapter = WeightsRef(job_id="job_a", folder="checkpoint-000004")
    lora = EnsureRequest(base_model="b", adapter=adapter)
    servers = [
        _server("other-base", ["c"], [_engine("c")]),
        _server("busy", ["b"], [_engine("b", running=9)]),
        _server("idle-cold", ["*"], []),
        _server("engine-up", ["b"], [_engine("b", running=5)]),
        _server(
            "adapter-up", ["b"], [_engine("b", running=7, adapters=["job_a/checkpoint-000004"])]
        ),
        _server("bad-state", ["b"], []),
    ]
    servers[-1].state = {"engines": "nonsense"}
    order = [c.server_id for c in routing.choose(servers, lora)]
    # The adapter loaded; then its engine up (the less loaded first: loading an adapter takes
    # a moment, starting an engine much longer); then cold servers; never another base's.
    assert order == ["adapter-up", "engine-up", "busy", "idle-cold", "bad-state"]
    base = EnsureRequest(base_model="b")
    assert [c.server_id for c in routing.choose(servers, base)][:3] == [
        "engine-up",  # the base engine is up in both; the less loaded first
        "adapter-up",
        "busy",
    ]
    full = EnsureRequest(
        base_model="b", full=WeightsRef(job_id="job_f", folder="checkpoint-000002")
    )
    warm_full = _server("full-up", ["b"], [_engine("job_f/checkpoint-000002", running=3)])
    assert routing.choose([*servers, warm_full], full)[0].server_id == "full-up"


def test_each_kind_of_model_asks_for_its_weights(api: Api) -> None:
    model = _hub_model()
    full = _job(api, model=model)
    _train(api.settings, full, [2], succeed=True)
    lora = _job(api, model=model, lora={"rank": 4}, init_from={"job_id": full, "step": 2})
    _train(api.settings, lora, [1, 3], succeed=False)
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:

            def ensure(name: str) -> EnsureRequest:
                resolved = routing.models.resolve_model(
                    session, project_id=api.project_id, name=name
                )
                return routing.ensure_request(session, project_id=api.project_id, model=resolved)

            assert ensure("tiny-random-llama") == EnsureRequest(base_model="tiny-random-llama")
            assert ensure(full) == EnsureRequest(
                base_model=model, full=WeightsRef(job_id=full, folder="checkpoint-000002")
            )
            assert ensure(f"{lora}@3") == EnsureRequest(
                base_model=model,
                adapter=WeightsRef(job_id=lora, folder="checkpoint-000003"),
                base_weights=WeightsRef(job_id=full, folder="checkpoint-000002"),
            )
    finally:
        engine.dispose()


def test_no_server_for_the_base_is_a_503_with_retry_after(api: Api) -> None:
    response = api.client.post(CHAT, json=_chat(), headers=api.headers)
    error = _error(response, 503)
    assert error["code"] == "no_inference_server" and "tiny-random-llama" in error["message"]
    assert response.headers["Retry-After"] == str(api.settings.inference_no_server_retry_after_s)


def test_a_busy_engine_is_a_503_with_its_retry_after_past_a_dead_server(
    api: Api, registry: Registry, control: ControlDouble
) -> None:
    model = _hub_model()
    job = _job(api, model=model)
    _train(api.settings, job, [1], succeed=True)
    # The dead one is warmest (asked first): connection refused, so the next one is asked.
    dead = f"http://127.0.0.1:{free_port()}"
    registry.register("dead", dead, [model], {**_state([_engine(model)])})
    registry.register("alive", control.url, ["*"])
    control.busy = Busy(reason="engine_starting", detail="loading the weights", retry_after_s=7)
    response = api.client.post(CHAT, json=_chat(model=job), headers=api.headers)
    error = _error(response, 503)
    assert error["code"] == "engine_starting" and response.headers["Retry-After"] == "7"
    assert control.received == [
        EnsureRequest(base_model=model, full=WeightsRef(job_id=job, folder="checkpoint-000001"))
    ]
    registry.unregister("alive")
    response = api.client.post(CHAT, json=_chat(model=job), headers=api.headers)
    assert _error(response, 503)["code"] == "inference_unavailable"
    assert "Retry-After" in response.headers


def _state(engines: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "engines": engines,
        "memory_budget_bytes": 1,
        "memory_used_bytes": 0,
        "max_adapters_per_engine": 1,
    }


# ---------------------------------------------------------------- usage and quota


def test_usage_adds_up_per_project_model_and_day(api: Api) -> None:
    engine = make_engine(api.settings.resolved_database_url)
    sessions = make_session_factory(engine)
    now = utcnow()
    try:
        for prompt, completion in ((3, 4), (10, 20)):
            with session_scope(sessions) as session:
                quota.record(
                    session,
                    project_id=api.project_id,
                    model="m1",
                    now=now,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                )
        with session_scope(sessions) as session:
            usage_repo.add(
                session,
                project_id=api.project_id,
                model="m2",
                day="2020-01-01",
                requests=1,
                prompt_tokens=1,
                completion_tokens=1,
            )
        with session_scope(sessions) as session:
            day = usage_repo.day_of(now)
            assert usage_repo.tokens_on(session, project_id=api.project_id, day=day) == 37
            rows, more = usage_repo.rows_since(
                session, project_id=api.project_id, since_day="2000-01-01", limit=1
            )
            assert more and rows == [usage_repo.UsageRow("m1", day, 2, 13, 24)]
    finally:
        engine.dispose()
    shown = api.client.get("/v1/usage", headers=api.headers).json()["inference"]
    assert shown["tokens_today"] == 37 and shown["daily_token_limit"] == 10_000_000
    assert shown["data"] == [
        {
            "model": "m1",
            "day": usage_repo.day_of(now),
            "requests": 2,
            "prompt_tokens": 13,
            "completion_tokens": 24,
            "total_tokens": 37,
        }
    ]  # 2020's row is older than the 7 days listed


def test_the_daily_quota_is_a_429_insufficient_quota(
    make_api: Callable[..., Api], control: ControlDouble
) -> None:
    api = make_api(inference_daily_tokens_per_project=30)
    registry = Registry(api.settings)
    try:
        registry.register("quota-test", control.url, ["tiny-random-llama"])
        engine = make_engine(api.settings.resolved_database_url)
        try:
            with session_scope(make_session_factory(engine)) as session:
                quota.record(
                    session,
                    project_id=api.project_id,
                    model="tiny-random-llama",
                    now=utcnow(),
                    prompt_tokens=10,
                    completion_tokens=20,
                )
        finally:
            engine.dispose()
        response = api.client.post(CHAT, json=_chat(), headers=api.headers)
        error = _error(response, 429)
        assert error["code"] == "insufficient_quota", error
        assert "GRPO_INFERENCE_DAILY_TOKENS_PER_PROJECT" in error["message"]
        assert response.headers["x-should-retry"] == "false"
        assert 1 <= int(response.headers["Retry-After"]) <= 86_400
        assert control.received == []  # refused before anything was forwarded
    finally:
        registry.close()


def test_seconds_to_midnight() -> None:
    from datetime import UTC, datetime

    assert quota.seconds_to_midnight(datetime(2026, 1, 1, 23, 59, 30, tzinfo=UTC)) == 30
    assert quota.seconds_to_midnight(datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)) == 86_400


# ---------------------------------------------------------------- fair use


def test_inference_has_a_request_budget_of_its_own(make_api: Callable[..., Api]) -> None:
    api = make_api(inference_rate_limit_per_minute=1, inference_rate_limit_burst=1)
    first = api.client.post(CHAT, json=_chat(), headers=api.headers)
    assert _error(first, 503)["code"] == "no_inference_server"  # passed the limit
    second = api.client.post(CHAT, json=_chat(), headers=api.headers)
    error = _error(second, 429)
    assert "chat and completion requests per minute" in error["message"]
    assert int(second.headers["Retry-After"]) >= 1
    # The rest of the API keeps its own budget.
    assert api.client.get("/v1/usage", headers=api.headers).status_code == 200


def test_a_project_has_a_cap_on_requests_in_flight(
    pg_url: str, sqlite_dir: Any, queue_name: str, control: ControlDouble
) -> None:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, queue_name, inference_max_concurrent_per_project=1
    )
    control.hold = threading.Event()
    registry = Registry(settings)
    try:
        with serve(settings) as server:
            registry.register("inflight-test", control.url, ["tiny-random-llama"])
            key, _ = new_project_key(settings)
            headers = {"Authorization": f"Bearer {key}"}
            held: list[httpx.Response] = []
            first = threading.Thread(
                target=lambda: held.append(
                    httpx.post(f"{server.url}{CHAT}", json=_chat(), headers=headers, timeout=30)
                )
            )
            first.start()
            wait_until(lambda: control.received, 10, "the first request to reach ensure")
            second = httpx.post(f"{server.url}{CHAT}", json=_chat(), headers=headers, timeout=30)
            error = _error(second, 429)
            assert "this project has 1 requests in flight" in error["message"]
            assert "GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT" in error["message"]
            assert second.headers["Retry-After"] == "5"
            other, _ = new_project_key(settings)  # another project is not held back
            control.busy = Busy(reason="memory_budget", detail="full", retry_after_s=2)
            third = httpx.post(
                f"{server.url}{CHAT}",
                json=_chat(),
                headers={"Authorization": f"Bearer {other}"},
                timeout=30,
            )
            control.hold.set()
            assert _error(third, 503)["code"] == "memory_budget"
            first.join(30)
            assert held and held[0].status_code == 503  # the double said busy to it too
            # Its slot was given back: the project may send again.
            again = httpx.post(f"{server.url}{CHAT}", json=_chat(), headers=headers, timeout=30)
            assert _error(again, 503)["code"] == "memory_budget"
    finally:
        registry.close()
