"""Issue 32's hostile-tenant findings on the inference gateway, the rules that need no engine:
the request shapes the engine cannot serve safely (refused before anything is forwarded), the
per-project budget of work in flight, model names with control characters, the engine's error
params named as the client's request names them, and the non-streamed answer passed on as the
engine's bytes. The inference process is ControlDouble (tests/app/gateway_doubles.py); what
the real engine does with each is tests/app/gateway/test_inference_tier.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from app.core.errors import TooManyRequests
from app.core.leases import Lease, RedisStore, WorkBudget
from app.gateway import answer, proxy
from app.gateway.engine_limits import HAZARDS
from app.gateway.request_schemas import ChatCompletionRequest, CompletionRequest
from tests.app.gateway_doubles import ControlDouble, Registry, serve_control
from tests.conftest import REDIS_URL, Api, new_project_key, settings_for, wait_until
from tests.live_server import serve

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TINY = "tiny-random-llama"

# One request of each shape in engine_limits.HAZARDS (a hazard without one here fails below).
HAZARD_EXAMPLES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "echo": [
        (COMPLETIONS, {"prompt": "hello world", "echo": True, "logprobs": 1}),
        (
            COMPLETIONS,
            {"prompt": "a " * 200, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 2},
        ),
        (COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 0}),
    ],
    "prompt_logprobs": [
        (COMPLETIONS, {"prompt": "hello", "prompt_logprobs": 1}),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}),
    ],
}


@pytest.fixture
def forwarded(api: Api) -> Iterator[ControlDouble]:
    """An inference process (its control API) serving the tiny base: a request that gets past
    the gateway's checks reaches its ensure (and then an engine that is not there)."""
    with serve_control(ControlDouble(base_url="http://127.0.0.1:1", served_model="x")) as double:
        registry = Registry(api.settings)
        registry.register("hazards", double.url, [TINY])
        try:
            yield double
        finally:
            registry.close()


def test_every_hazard_has_an_example() -> None:
    assert {hazard.param for hazard in HAZARDS} == set(HAZARD_EXAMPLES)


@pytest.mark.parametrize(
    ("param", "path", "body"),
    [(param, path, body) for param, cases in HAZARD_EXAMPLES.items() for path, body in cases],
)
def test_what_crashes_the_engine_is_refused_before_it_is_forwarded(
    api: Api, forwarded: ControlDouble, param: str, path: str, body: dict[str, Any]
) -> None:
    response = api.client.post(path, json={"model": TINY, **body}, headers=api.headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
    assert forwarded.received == []  # no inference process was asked for anything


def test_what_is_safe_goes_through_to_an_engine_that_is_down_a_503(
    api: Api, forwarded: ControlDouble
) -> None:
    """echo alone, and logprobs alone, are forwarded; the engine the double names does not
    answer (as one that died), which is a 503 with Retry-After, not a 502."""
    for body in ({"prompt": "hi", "echo": True}, {"prompt": "hi", "logprobs": 5}):
        response = api.client.post(COMPLETIONS, json={"model": TINY, **body}, headers=api.headers)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_unavailable"
        assert int(response.headers["Retry-After"]) >= 1
    assert len(forwarded.received) == 2


# ---------------------------------------------------------------- the work in flight


def test_a_project_has_a_budget_of_work_in_flight(
    pg_url: str, sqlite_dir: Path, queue_name: str
) -> None:
    """A's held request of 16 choices x 1,000 tokens leaves A no room for another of its size
    (429 with Retry-After, naming the setting) while A's small request and B's large one go."""
    settings = settings_for(
        "postgres",
        pg_url,
        sqlite_dir,
        queue_name,
        inference_max_tokens_in_flight_per_project=20_000,
    )
    double = ControlDouble(base_url="http://127.0.0.1:1", served_model="x")
    double.hold = threading.Event()
    big = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "n": 16}
    big["max_tokens"] = 1000
    with serve_control(double), serve(settings) as server:
        registry = Registry(settings)
        try:
            registry.register("work-test", double.url, [TINY])
            a = {"Authorization": f"Bearer {new_project_key(settings)[0]}"}
            b = {"Authorization": f"Bearer {new_project_key(settings)[0]}"}
            held: list[httpx.Response] = []

            def post(headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
                return httpx.post(f"{server.url}{CHAT}", json=body, headers=headers, timeout=30)

            first = threading.Thread(target=lambda: held.append(post(a, big)))
            first.start()
            wait_until(lambda: double.received, 10, "A's first request to reach ensure")
            refused = post(a, big)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert "GRPO_INFERENCE_MAX_TOKENS_IN_FLIGHT_PER_PROJECT" in error["message"]
            assert "16002" in error["message"] and int(refused.headers["Retry-After"]) >= 1
            small = {**big, "n": 1, "max_tokens": 16}
            assert post(a, small).status_code == 503  # within the budget: forwarded
            assert post(b, big).status_code == 503  # another project's budget
            assert len(double.received) == 3
            double.hold.set()
            first.join(30)
            assert held and held[0].status_code == 503
            alone = {**big, "max_tokens": 4000}  # 64,002: past the budget, but alone
            assert post(a, alone).status_code == 503
        finally:
            double.hold.set()
            registry.close()


@pytest.mark.parametrize("redis_url", [REDIS_URL, None])
def test_work_leases_sum_per_owner_and_free_on_release(redis_url: str | None) -> None:
    budget = WorkBudget(100, RedisStore(redis_url), setting="THE_SETTING")
    owner = f"project-{threading.get_ident()}-{redis_url is None}"
    first = budget.acquire(owner, 60)
    second = budget.acquire(owner, 40)  # exactly the budget
    with pytest.raises(TooManyRequests, match="THE_SETTING"):
        budget.acquire(owner, 1)
    budget.acquire(f"{owner}-other", 100)  # owners are apart
    budget.release(first)
    budget.release(first)  # idempotent: frees 60 once
    third = budget.acquire(owner, 60)
    for lease in (second, third):
        budget.release(lease)
    alone: Lease = budget.acquire(owner, 1000)  # larger than the budget, but alone
    with pytest.raises(TooManyRequests):
        budget.acquire(owner, 1)
    budget.release(alone)


def test_a_request_counts_choices_times_tokens_plus_its_prompt() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "12345"}], "n": 3}
    )
    assert chat.work(default_new_tokens=100) == 3 * 100 + 5
    chat = chat.model_copy(update={"max_tokens": 50, "max_completion_tokens": 20})
    assert chat.work(default_new_tokens=100) == 3 * 20 + 5  # vLLM's precedence
    done = CompletionRequest.model_validate(
        {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "max_tokens": 7}
    )
    assert done.work(default_new_tokens=100) == 2 * 2 * 7 + 3


# ---------------------------------------------------------------- names and params


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%09"])
def test_a_model_name_with_control_characters_is_a_400(api: Api, suffix: str) -> None:
    response = api.client.get(f"/v1/models/{TINY}{suffix}", headers=api.headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model"
    assert api.client.get(f"/v1/models/{TINY}", headers=api.headers).status_code == 200
    chat = {"model": f"{TINY}\n", "messages": [{"role": "user", "content": "x"}]}
    response = api.client.post(CHAT, json=chat, headers=api.headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def _vllm_error(param: str | None, message: str = "refused") -> bytes:
    """vLLM's error body, as its server writes it."""
    error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
    return json.dumps({"error": error}).encode()


@pytest.mark.parametrize(
    ("engine_param", "chat_param", "completion_param"),
    [
        ("input_text", "messages", "prompt"),  # the prompt's characters past the context
        ("input_tokens", "messages", "prompt"),
        ("max_tokens", "max_tokens", "max_tokens"),
        ("response_format", "response_format", "response_format"),
        ("kv_transfer_params.prompt_token_ids", None, None),  # vLLM's internals: dropped
        ("truncate_prompt_tokens", None, None),
        (None, None, None),
    ],
)
def test_the_engines_error_params_are_the_requests_fields(
    engine_param: str | None, chat_param: str | None, completion_param: str | None
) -> None:
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    done = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    for body, expected in ((chat, chat_param), (done, completion_param)):
        error = proxy.upstream_error(400, _vllm_error(engine_param), body=body, served_model="s")
        assert (error.status_code, error.param) == (400, expected)


# ---------------------------------------------------------------- the answer's bytes


def _completion_answer(model: str) -> bytes:
    """A completions answer (vLLM's key order) whose top_logprobs hold tokens named like the
    answer's own keys, one with a quote."""
    top = {"model": -0.5, "usage": -1.0, "choices": -2.0, 'x"model': -3.0}
    answer_ = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "text": '"model": "nope"', "logprobs": {"top_logprobs": [top]}}],
        "service_tier": None,
        "usage": {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3},
        "kv_transfer_params": None,
    }
    return json.dumps(answer_).encode()


def test_the_answer_is_passed_on_with_only_its_model_rewritten() -> None:
    raw = _completion_answer("engine-name")
    out = anyio.run(answer.with_client_model, raw, "ft:mine::job_1 é")
    data, original = json.loads(out), json.loads(raw)
    assert data["model"] == "ft:mine::job_1 é"
    assert {k: v for k, v in data.items() if k != "model"} == {
        k: v for k, v in original.items() if k != "model"
    }
    assert out.endswith(raw[raw.index(b'"choices"') :])  # the rest is the engine's bytes
    assert answer.usage_in(raw[-200:]) == original["usage"]
    # Shaped otherwise (model after choices): parsed whole, still rewritten.
    moved = json.dumps({"choices": [], "model": "engine-name"}).encode()
    assert json.loads(anyio.run(answer.with_client_model, moved, "mine"))["model"] == "mine"
