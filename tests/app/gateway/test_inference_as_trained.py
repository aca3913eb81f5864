"""Issue 32, item 2, on the gateway's side (no engine; the registry is real rows on both
databases):

- a base model an inference process names in its GRPO_INFERENCE_BASES (a Hub id, a folder) is
  a model like the packaged ones: listed, retrieved, routed; `*` names none;
- a job's weights are asked for with its base model's revision and its rollout dtype, and a
  server whose engine already runs the base at that revision and dtype is asked first.

The real `grpo inference` process serving such a base, end to end, is
tests/inference/test_served_as_trained.py."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.gateway import routing
from app.gateway.engine_identity import EngineOptions, engine_key
from app.gateway.protocol import EnsureRequest, WeightsRef
from jobspec import PACKAGED_MODELS
from tests.app.gateway.test_inference_rules import _engine, _hub_model, _state
from tests.app.gateway.test_models_catalogue import _job, _not_found, _train
from tests.app.gateway_doubles import Registry
from tests.conftest import Api


@pytest.fixture
def registry(api: Api) -> Iterator[Registry]:
    reg = Registry(api.settings)
    yield reg
    reg.close()


def _plan(api: Api, name: str) -> routing.Plan:
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return routing.plan(
                session, project_id=api.project_id, name=name, no_server_retry_after=1
            )
    finally:
        engine.dispose()


def test_a_base_an_inference_process_serves_by_name_is_a_model_as_the_packaged_ones(
    api: Api, registry: Registry
) -> None:
    served, other = _hub_model(), _hub_model()
    path = f"/v1/models/{quote(served, safe='')}"
    _not_found(api.client.get(path, headers=api.headers), served)  # nothing serves it yet

    registry.register("names-it", "http://127.0.0.1:1", [served, "tiny-random-llama"])
    registry.register("any", "http://127.0.0.1:2", ["*"])
    listed = api.client.get("/v1/models", headers=api.headers).json()["data"]
    assert [m["id"] for m in listed] == [*PACKAGED_MODELS, served]  # `*` lists nothing
    model = api.client.get(path, headers=api.headers).json()
    assert (model["id"], model["owned_by"], model["grpo_service"]["kind"]) == (
        served,
        "system",
        "base",
    )
    plan = _plan(api, served)
    assert plan.ensure == EnsureRequest(base_model=served)
    assert plan.options == EngineOptions()  # a bare base answers as a job's first rollouts
    assert [c.server_id for c in plan.candidates] == ["names-it", "any"]
    _not_found(api.client.get(f"/v1/models/{quote(other, safe='')}", headers=api.headers), other)


def test_a_jobs_weights_are_asked_for_at_its_revision_in_its_rollout_dtype(
    api: Api, registry: Registry
) -> None:
    hub = _hub_model()
    job = _job(
        api,
        model=hub,
        model_revision="v2",
        lora={"rank": 4},
        rollout={"engine": "transformers", "dtype": "bfloat16"},
    )
    _train(api.settings, job, [1], succeed=True)
    at_main = _state([_engine(hub)])  # the base's engine at main, in float32: another engine
    at_v2 = _state([_engine(engine_key(hub, revision="v2", dtype="bfloat16"))])
    registry.register("main-engine", "http://127.0.0.1:1", [hub], at_main)
    registry.register("v2-engine", "http://127.0.0.1:2", [hub], at_v2)

    plan = _plan(api, job)
    assert plan.ensure == EnsureRequest(
        base_model=hub, adapter=WeightsRef(job_id=job, folder="checkpoint-000001")
    )
    assert plan.options == EngineOptions(revision="v2", dtype="bfloat16")
    assert [(c.server_id, c.warmth) for c in plan.candidates] == [
        ("v2-engine", routing.ENGINE_WARM),
        ("main-engine", routing.COLD),
    ]
