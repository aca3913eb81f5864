"""A project's share of an engine's adapter slots, as an HTTP client of the API sees it: the
real API (uvicorn), the real control API over the real pool (inference.control,
inference.pool) on two adapter slots (a project's share: one), and a stand-in for the vLLM
server behind the stand-in engines (tests.inference.test_pool's, pointed at it), which holds
a request open for as long as the test says.

- A project whose request uses its one slot gets 429 ``adapter_share`` with Retry-After and a
  message naming GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT for another of its adapters, while
  another project's adapter answers 200.
- Requests in flight on every slot: 503 ``adapter_capacity`` with Retry-After, never a 500.
- The gateway gives the adapter back when its request ends, however it ends: answered,
  failed upstream, a stream ended, a client that left mid-stream. The holds here never lapse
  on their own (a keep of 600 s), so every 200 after a 429 below is a release."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.core.settings import Settings
from inference import pool as pool_module
from inference.control import create_control_app
from inference.engine import EngineSpec
from inference.pool import EnginePool
from inference.settings import build_inference_settings
from tests.app.gateway.test_models_catalogue import _train
from tests.app.gateway_doubles import Registry
from tests.conftest import RecordingDispatcher, free_port, settings_for, tiny_spec, wait_until
from tests.inference.test_pool import TRAITS, StandInEngine
from tests.live_server import Server, serve

TINY = "tiny-random-llama"
CHAT = "/v1/chat/completions"


@dataclass
class StandInVllm:
    """The OpenAI routes of a vLLM server, answering "ok" under the model asked; a model in
    ``gates`` waits for its event first (a stream sends one chunk, then waits), one in
    ``failing`` answers 500."""

    gates: dict[str, threading.Event] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    arrived: list[str] = field(default_factory=list)

    async def _gate(self, model: str) -> None:
        gate = self.gates.get(model)
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.02)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        @app.post(CHAT)
        async def chat(request: Request) -> Response:
            body = await request.json()
            model = str(body["model"])
            self.arrived.append(model)
            if model in self.failing:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if body.get("stream"):
                return StreamingResponse(self._chunks(model), media_type="text/event-stream")
            await self._gate(model)
            message = {"role": "assistant", "content": "ok"}
            return JSONResponse(
                {
                    "id": "chat-1",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            )

        return app

    async def _chunks(self, model: str) -> AsyncIterator[bytes]:
        delta = {"index": 0, "delta": {"content": "ok"}, "finish_reason": None}
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": model, "choices": [delta]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await self._gate(model)
        yield b"data: [DONE]\n\n"


class EngineBehindVllm(StandInEngine):
    """test_pool's stand-in engine, its server the stand-in vLLM at ``url``."""

    url: ClassVar[str] = ""

    def __init__(self, spec: EngineSpec, settings: Any, launcher: Any) -> None:
        super().__init__(spec, settings, launcher)
        self.base_url = EngineBehindVllm.url


@contextmanager
def served(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="share-test-server", daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "a test server to start", interval=0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class Tier:
    """The API, the control API of a pool of two adapter slots, and the stand-in vLLM."""

    def __init__(self, server: Server, vllm: StandInVllm) -> None:
        self.server, self.vllm = server, vllm

    def project(self) -> dict[str, str]:
        return self.server.key()

    def lora_model(self, headers: dict[str, str]) -> str:
        """A succeeded LoRA job of the project, its checkpoint in the store; its native name."""
        spec = {**tiny_spec(), "lora": {"rank": 4}}
        response = httpx.post(f"{self.server.url}/v1/jobs", json=spec, headers=headers)
        assert response.status_code == 201, response.text
        job = str(response.json()["id"])
        _train(self.server.settings, job, [1], succeed=True)
        folder = self.server.settings.resolved_checkpoint_dir / job / "checkpoint-000001"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
        return job

    def chat(self, headers: dict[str, str], model: str, **extra: Any) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        return httpx.post(f"{self.server.url}{CHAT}", json=body, headers=headers, timeout=30)

    def ready(self, headers: dict[str, str], model: str) -> httpx.Response:
        """Chat until the engine is up (503 engine_starting before)."""

        def answered() -> httpx.Response | None:
            response = self.chat(headers, model)
            if response.status_code == 503 and "engine_starting" in response.text:
                return None
            return response

        found = wait_until(answered, 30, f"{model} to answer", interval=0.05)
        assert isinstance(found, httpx.Response)
        return found

    def in_flight(self, headers: dict[str, str], model: str) -> tuple[threading.Thread, list[Any]]:
        """A request held open at the engine (its gate closed) until the gate opens."""
        self.vllm.gates[f"{model}/checkpoint-000001"] = threading.Event()
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(self.chat(headers, model)))
        arrived = len(self.vllm.arrived)
        thread.start()
        wait_until(lambda: len(self.vllm.arrived) > arrived, 10, f"{model} at the engine")
        return thread, done

    def open_gate(self, model: str) -> None:
        self.vllm.gates[f"{model}/checkpoint-000001"].set()


@pytest.fixture
def tier(
    pg_url: str, sqlite_dir: Path, queue_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Tier]:
    settings: Settings = settings_for("postgres", pg_url, sqlite_dir, queue_name)
    vllm = StandInVllm()
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"w" * 1000)
    monkeypatch.setattr(pool_module, "resolve_base", lambda model, settings, **_: base)
    monkeypatch.setattr(pool_module, "chat_traits", lambda folder, **_: TRAITS)
    monkeypatch.setattr(pool_module, "Engine", EngineBehindVllm)
    StandInEngine.instances, StandInEngine.adapters_in_use = [], frozenset()
    pool = EnginePool(
        build_inference_settings(
            bases=TINY, max_adapters=2, keep_after_ensure_s=600, kv_cache_bytes=100
        ),
        settings,
    )
    with (
        served(vllm.app()) as vllm_url,
        served(create_control_app(pool)) as control_url,
        serve(settings, RecordingDispatcher()) as server,
    ):
        monkeypatch.setattr(EngineBehindVllm, "url", vllm_url)
        registry = Registry(settings)
        try:
            registry.register(f"share-{secrets.token_hex(3)}", control_url, [TINY])
            yield Tier(server, vllm)
        finally:
            for gate in vllm.gates.values():
                gate.set()
            registry.close()


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert int(response.headers["Retry-After"]) >= 1
    return str(error["message"])


def test_a_projects_share_is_a_429_the_engines_capacity_a_503_and_others_are_served(
    tier: Tier,
) -> None:
    a, b, c = tier.project(), tier.project(), tier.project()
    a1, a2, b1, c1 = (tier.lora_model(p) for p in (a, a, b, c))
    assert tier.ready(a, a1).status_code == 200  # starts the engine; a1 loaded, released

    a_running, a_done = tier.in_flight(a, a1)
    message = _error(tier.chat(a, a2), 429, "adapter_share")
    assert "GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT=1" in message, message
    assert "holds 1 of the 2 adapter slots" in message
    b_running, b_done = tier.in_flight(b, b1)  # another project: the free slot, at once
    message = _error(tier.chat(c, c1), 503, "adapter_capacity")
    assert "GRPO_INFERENCE_MAX_ADAPTERS" in message and "2 adapter slots" in message

    tier.open_gate(a1)
    a_running.join(30)
    assert a_done and a_done[0].status_code == 200, a_done
    assert tier.chat(a, a2).status_code == 200  # A's request ended: its slot is A's again
    tier.open_gate(b1)
    b_running.join(30)
    assert b_done and b_done[0].status_code == 200, b_done
    assert tier.chat(c, c1).status_code == 200


def test_the_adapter_is_given_back_however_the_request_ends(tier: Tier) -> None:
    """Each way of ending is followed by A's other adapter answering 200: had the hold of
    the ended request stayed, it would be a 429 (A's share is one slot)."""
    a = tier.project()
    first, second = tier.lora_model(a), tier.lora_model(a)
    assert tier.ready(a, first).status_code == 200  # answered

    def served_next(model: str) -> bool:
        response = tier.chat(a, model)
        assert response.status_code in (200, 429), response.text
        return response.status_code == 200

    assert served_next(second)
    tier.vllm.failing.add(f"{second}/checkpoint-000001")
    assert tier.chat(a, second).status_code == 502  # the engine failed it
    assert served_next(first)
    streamed = tier.chat(a, first, stream=True)  # a stream to its end
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    tier.vllm.failing.clear()
    assert served_next(second)

    # A client that leaves mid-stream: the gateway notices, closes the engine's stream and
    # gives the adapter back (waited on: the disconnect is seen asynchronously).
    tier.vllm.gates[f"{first}/checkpoint-000001"] = threading.Event()
    body = {"model": first, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{tier.server.url}{CHAT}", json=body, headers=a) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator would close the connection
        assert next(line for line in lines if line.startswith("data: "))
        assert tier.chat(a, second).status_code == 429  # held while the stream is open
    wait_until(lambda: served_next(second), 20, "the left stream's adapter to be given back")
