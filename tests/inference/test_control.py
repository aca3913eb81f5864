"""The control API's HTTP shapes (app.gateway.protocol) over a stand-in pool: Busy is a 503
with Retry-After, errors are {"detail"} with their status, and the shared secret is checked."""

from __future__ import annotations

from typing import Any, cast

from fastapi.testclient import TestClient

from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import (
    ENSURE_PATH,
    TOKEN_HEADER,
    Busy,
    EnsureResponse,
    ServerState,
)
from inference.control import create_control_app
from inference.pool import EnginePool
from inference.records import EnsureError
from inference.settings import build_inference_settings


class StandInPool:
    def __init__(self, answer: EnsureResponse | Busy | EnsureError, token: str | None) -> None:
        self.settings = build_inference_settings(token=token)
        self.answer = answer
        self.asked: list[EngineEnsureRequest] = []

    async def ensure(self, request: EngineEnsureRequest) -> EnsureResponse | Busy:
        self.asked.append(request)
        if isinstance(self.answer, EnsureError):
            raise self.answer
        return self.answer

    async def state(self) -> ServerState:
        return ServerState(
            engines=[], memory_budget_bytes=10, memory_used_bytes=0, max_adapters_per_engine=2
        )


def _client(answer: Any, token: str | None = None) -> tuple[TestClient, StandInPool]:
    pool = StandInPool(answer, token)
    return TestClient(create_control_app(cast(EnginePool, pool))), pool


BASE = {"base_model": "tiny-random-llama"}


def test_ready_weights_answer_200_with_the_server_and_name() -> None:
    ready = EnsureResponse(base_url="http://127.0.0.1:9", served_model="m", warm=True)
    client, pool = _client(ready)
    response = client.post(ENSURE_PATH, json=BASE)
    assert response.status_code == 200 and EnsureResponse(**response.json()) == ready
    assert pool.asked == [EngineEnsureRequest(**BASE)]  # the trainer's default dtype, main


def test_the_jobs_revision_and_rollout_dtype_reach_the_pool() -> None:
    ready = EnsureResponse(base_url="http://127.0.0.1:9", served_model="m", warm=True)
    client, pool = _client(ready)
    body = {**BASE, "revision": "v2", "dtype": "bfloat16"}
    assert client.post(ENSURE_PATH, json=body).status_code == 200
    assert (pool.asked[0].revision, pool.asked[0].dtype) == ("v2", "bfloat16")


def test_busy_is_a_503_with_retry_after() -> None:
    busy = Busy(reason="engine_starting", detail="starting", retry_after_s=5)
    client, _ = _client(busy)
    response = client.post(ENSURE_PATH, json=BASE)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert Busy(**response.json()) == busy


def test_errors_keep_their_status_and_detail() -> None:
    client, _ = _client(EnsureError(403, "leads outside the checkpoint store"))
    response = client.post(ENSURE_PATH, json=BASE)
    assert (response.status_code, response.json()) == (
        403,
        {"detail": "leads outside the checkpoint store"},
    )


def test_a_malformed_checkpoint_name_never_reaches_the_pool() -> None:
    client, pool = _client(EnsureError(500, "unused"))
    bad = {**BASE, "adapter": {"job_id": "job_a", "folder": "../../etc"}}
    assert client.post(ENSURE_PATH, json=bad).status_code == 422
    assert pool.asked == []


def test_with_a_token_every_call_but_health_must_carry_it() -> None:
    ready = EnsureResponse(base_url="http://127.0.0.1:9", served_model="m", warm=True)
    client, _ = _client(ready, token="s3cret")
    assert client.post(ENSURE_PATH, json=BASE).status_code == 401
    assert client.post(ENSURE_PATH, json=BASE, headers={TOKEN_HEADER: "wrong"}).status_code == 401
    assert client.get("/engines").status_code == 401
    assert client.post(ENSURE_PATH, json=BASE, headers={TOKEN_HEADER: "s3cret"}).status_code == 200
    assert client.get("/engines", headers={TOKEN_HEADER: "s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200
