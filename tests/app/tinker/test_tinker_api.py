"""The Tinker API's rules over HTTP, without a worker (each on Postgres and on the embedded
SQLite): the tml- key, sessions that end, one project never reaching another's objects, quotas
answered 429 with Retry-After, training calls accepted once per seq_id and in order, bounded
bodies, and a dead worker's calls failing with the state to restore from."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerSession
from app.main import create_app
from tests.conftest import new_project_key


class Tinker:
    """A project's client of the Tinker API (raw HTTP, as the SDK sends it)."""

    def __init__(self, client: TestClient, settings: Settings, key: str | None = None) -> None:
        self.client = client
        self.settings = settings
        self.key = key or "tml-" + new_project_key(settings)[0]

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": self.key})

    def session(self) -> str:
        answer = self.post("create_session", {"tags": [], "sdk_version": "0.38.0"})
        assert answer.status_code == 200, answer.text
        return str(answer.json()["session_id"])

    def model(self, session_id: str, n: int = 0) -> str:
        answer = self.post(
            "create_model",
            {"session_id": session_id, "model_seq_id": n, "base_model": "tiny-random-llama",
             "lora_config": {"rank": 4}},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        return str(answer.json()["model_id"])

    def optim(self, model_id: str, seq_id: int) -> Any:
        return self.post(
            "optim_step",
            {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-4}},
        )


@pytest.fixture
def tinker(settings: Settings) -> Iterator[Tinker]:
    tuned = settings.model_copy(update={"tinker_max_models_per_project": 2,
                                        "tinker_poll_wait_s": 0.3, "tinker_max_body_bytes": 100_000})  # fmt: skip
    with TestClient(create_app(tuned)) as client:
        yield Tinker(client, tuned)


def edit(settings: Settings, table: type[Any], key: str, **values: Any) -> None:
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            row = db.get(table, key)
            assert row is not None
            for name, value in values.items():
                setattr(row, name, value)
    finally:
        engine.dispose()


def test_a_key_without_the_tml_prefix_or_unknown_is_401(tinker: Tinker) -> None:
    path = "/api/v1/get_server_capabilities"
    assert tinker.client.get(path, headers={"X-API-Key": tinker.key}).status_code == 200
    assert tinker.client.get(path, headers={"X-API-Key": tinker.key[4:]}).status_code == 401
    assert tinker.client.get(path).status_code == 401
    models = tinker.client.get(path, headers={"X-API-Key": tinker.key}).json()
    assert "tiny-random-llama" in [m["model_name"] for m in models["supported_models"]]


def test_a_session_lives_by_its_heartbeats_and_ends_with_410(tinker: Tinker) -> None:
    session_id = tinker.session()
    beat = tinker.post("session_heartbeat", {"session_id": session_id})
    assert beat.status_code == 200 and beat.json() == {"type": "session_heartbeat"}
    edit(tinker.settings, TinkerSession, session_id, heartbeat_at=utcnow() - timedelta(hours=1))
    late = tinker.post("session_heartbeat", {"session_id": session_id})
    assert late.status_code == 410 and "heartbeat" in late.json()["error"]["message"]
    finished = tinker.session()
    assert (
        tinker.post(f"sessions/{finished}/finish", {"reason": {"type": "success"}}).status_code
        == 200
    )
    assert tinker.post("session_heartbeat", {"session_id": finished}).status_code == 410


def test_another_project_reaches_nothing_of_a_session_or_model(tinker: Tinker) -> None:
    session_id = tinker.session()
    model_id = tinker.model(session_id)
    other = Tinker(tinker.client, tinker.settings)
    assert other.post("session_heartbeat", {"session_id": session_id}).status_code == 404
    assert other.optim(model_id, 1).status_code == 404
    assert other.post("get_info", {"model_id": model_id}).status_code == 404
    first = tinker.optim(model_id, 1).json()["request_id"]
    foreign = other.post("retrieve_future", {"request_id": first})
    assert foreign.status_code == 404
    listed = other.client.get(
        f"/api/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": other.key}
    )
    assert listed.status_code == 404


def test_training_calls_are_taken_once_per_seq_id_and_in_order(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    first = tinker.optim(model_id, 1)
    assert first.status_code == 200
    again = tinker.optim(model_id, 1)  # the SDK re-sends a call it got no answer for
    assert again.json()["request_id"] == first.json()["request_id"]
    assert tinker.optim(model_id, 3).status_code == 200  # a rejected seq_id 2 is skipped
    behind = tinker.optim(model_id, 2)
    assert behind.status_code == 400 and "wrong seq order" in behind.json()["error"]["message"]


def test_unknown_base_models_bad_ranks_and_the_model_quota(tinker: Tinker) -> None:
    session_id = tinker.session()
    unknown = tinker.post(
        "create_model",
        {"session_id": session_id, "model_seq_id": 0, "base_model": "nobody/nothing",
         "lora_config": {"rank": 4}},
    )  # fmt: skip
    assert unknown.status_code == 400 and "base_model" in unknown.json()["error"]["message"]
    tinker.model(session_id, 1)
    tinker.model(session_id, 2)
    full = tinker.post(
        "create_model",
        {"session_id": session_id, "model_seq_id": 3, "base_model": "tiny-random-llama",
         "lora_config": {"rank": 4}},
    )  # fmt: skip
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1


def test_a_poll_of_a_queued_call_says_try_again(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    request_id = tinker.optim(model_id, 1).json()["request_id"]
    waiting = tinker.post("retrieve_future", {"request_id": request_id})
    assert waiting.status_code == 200
    assert waiting.json() == {
        "type": "try_again",
        "request_id": request_id,
        "queue_state": "active",
    }


def test_a_dead_workers_calls_fail_naming_the_state_to_restore(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    request_id = tinker.optim(model_id, 1).json()["request_id"]
    saved = f"tinker://{model_id}/weights/step-4"
    stale = utcnow() - timedelta(seconds=tinker.settings.lease_seconds * 3)
    edit(tinker.settings, TinkerModel, model_id, status="ready", lease_owner="gone",
         heartbeat_at=stale, last_saved_path=saved)  # fmt: skip
    failed = tinker.post("retrieve_future", {"request_id": request_id}).json()
    assert failed["category"] == "server" and saved in failed["error"]
    later = tinker.optim(model_id, 2)
    assert later.status_code == 410 and saved in later.json()["error"]["message"]


def test_bodies_and_batches_are_bounded(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    huge = tinker.client.post(
        "/api/v1/forward_backward",
        content=b"\x00" * (tinker.settings.tinker_max_body_bytes + 1),
        headers={"X-API-Key": tinker.key, "Content-Type": "application/x-protobuf"},
    )
    assert huge.status_code == 413
    garbage = tinker.client.post(
        "/api/v1/forward_backward",
        content=b"\xff\xff\xff",
        headers={"X-API-Key": tinker.key, "Content-Type": "application/x-protobuf"},
    )
    assert garbage.status_code == 400
    many = tinker.post(
        "asample",
        {"sampling_session_id": f"{model_id}", "seq_id": 0, "num_samples": 10_000,
         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
         "sampling_params": {"max_tokens": 4}},
    )  # fmt: skip
    assert many.status_code == 422 and "num_samples" in many.json()["error"]["message"]


@pytest.mark.parametrize(
    "option",
    [{"topk_sample_logprobs": 5}, {"prompt_logprobs_last_n": 3}, {"record_stability_info": True}],
)
def test_sample_options_not_served_are_a_400_naming_them(
    tinker: Tinker, option: dict[str, Any]
) -> None:
    model_id = tinker.model(tinker.session())
    answer = tinker.post(
        "asample",
        {"sampling_session_id": model_id, "seq_id": 0, "num_samples": 1,
         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
         "sampling_params": {"max_tokens": 4}, **option},
    )  # fmt: skip
    (name,) = option
    assert answer.status_code == 400 and name in answer.json()["error"]["message"]


def test_a_client_no_worker_takes_waits_for_capacity_then_fails(tinker: Tinker) -> None:
    model_id = tinker.model(tinker.session())
    request_id = tinker.optim(model_id, 1).json()["request_id"]
    # The wait counts from when the model went to the queue (created, or called once released).
    edit(tinker.settings, TinkerModel, model_id, queued_at=utcnow() - timedelta(seconds=60))
    waiting = tinker.post("retrieve_future", {"request_id": request_id}).json()
    assert waiting["type"] == "try_again" and waiting["queue_state"] == "paused_capacity"
    assert model_id in waiting["queue_state_reason"]
    timeout = tinker.settings.tinker_claim_timeout_s
    edit(tinker.settings, TinkerModel, model_id,
         queued_at=utcnow() - timedelta(seconds=timeout + 1))  # fmt: skip
    failed = tinker.post("retrieve_future", {"request_id": request_id}).json()
    assert failed["category"] == "server" and "no worker took" in failed["error"]
    # The model no longer counts against the project's quota of live training clients.
    assert tinker.optim(model_id, 2).status_code == 410
    session_id = tinker.session()
    tinker.model(session_id)
    tinker.model(session_id, 1)  # the quota is 2 (the fixture): both fit


def test_a_sampling_session_over_a_base_model_alone(tinker: Tinker) -> None:
    session_id = tinker.session()
    made = tinker.post(
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny-random-llama"},
    )
    assert made.status_code == 200, made.text
    sampler_id = made.json()["sampling_session_id"]
    assert sampler_id == f"{session_id}:sample:0"
    again = tinker.post(
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny-random-llama"},
    )
    assert again.json()["sampling_session_id"] == sampler_id  # a retried creation
    info = tinker.client.get(f"/api/v1/samplers/{sampler_id}", headers={"X-API-Key": tinker.key})
    assert info.json() == {"sampler_id": sampler_id, "base_model": "tiny-random-llama",
                           "model_path": None}  # fmt: skip
    sample = tinker.post(
        "asample",
        {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 2,
         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 5, 6]}]},
         "sampling_params": {"max_tokens": 4}},
    )  # fmt: skip
    assert sample.status_code == 200, sample.text
    # The model behind it takes no training calls, and it counts as one of the project's two.
    hidden = f"{session_id}:base:0"
    refused = tinker.optim(hidden, 1)
    assert refused.status_code == 400 and "no training calls" in refused.json()["error"]["message"]
    tinker.model(session_id)
    full = tinker.post(
        "create_model",
        {"session_id": session_id, "model_seq_id": 1, "base_model": "tiny-random-llama",
         "lora_config": {"rank": 4}},
    )  # fmt: skip
    assert full.status_code == 429
    unknown = tinker.post(
        "create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 1, "base_model": "nobody/nothing"},
    )
    assert unknown.status_code == 400 and "base_model" in unknown.json()["error"]["message"]
