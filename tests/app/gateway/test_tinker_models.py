"""A Tinker client's sampler weights saves as models of the OpenAI face (on Postgres and on the
embedded SQLite): listed by GET /v1/models with their `tinker://` path, resolved by their `ft:`
name or their path into LoRA adapters over the client's base model, and a 404
`model_not_found` for anything the project cannot use: another project's save, a weights
(state) save, a save that expired, an `ft:` name with the wrong base model. A client named by an
alias (GRPO_TINKER_MODEL_ALIASES) is served on the alias's packaged model. The answer through
a real inference process is tests/inference/test_tinker_served.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.gateway import routing
from app.gateway.protocol import SamplerWeightsRef
from app.gateway.served_kinds import served_name
from app.gateway.service import resolve_model
from app.main import create_app
from app.tinker import worker_repository
from app.tinker.names import read_sampler_model_name, sampler_model_name
from jobspec import PACKAGED_MODELS
from tests.app.tinker.test_tinker_api import Tinker
from tests.conftest import Api, new_project_key

TINY = "tiny-random-llama"


def _save(
    settings: Settings, project_id: str, model_id: str, kind: str, name: str, **when: Any
) -> None:
    """The row a worker records once it wrote a save (worker/tinker_saves.py)."""
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            worker_repository.record_checkpoint(
                db, model_id=model_id, project_id=project_id, kind=kind, name=name,
                folder="/unused", size_bytes=1, user_metadata=None,
                now=when.get("now", utcnow()), expires_at=when.get("expires_at"),
            )  # fmt: skip
    finally:
        engine.dispose()


def _client(api: Api) -> tuple[Tinker, str]:
    tinker = Tinker(api.client, api.settings, "tml-" + api.key)
    return tinker, tinker.model(tinker.session())


def _get(api: Api, name: str, key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else api.headers
    return api.client.get(f"/v1/models/{quote(name, safe='')}", headers=headers)


def test_the_names_read_back() -> None:
    name = sampler_model_name("org/Model:v2", "s-1:train:3", "final.2")
    assert name == "ft:org/Model:v2:final.2:s-1:train:3"
    read = read_sampler_model_name(name)
    assert read is not None and read == ("s-1:train:3", "final.2", "org/Model:v2")
    path = read_sampler_model_name("tinker://s-1:train:3/sampler_weights/final.2")
    assert path is not None and path == ("s-1:train:3", "final.2", None)
    for other in (
        "tinker://s-1:train:3/weights/final",  # a state save: not a model
        "ft:tiny:suffix:job_0123abc",  # a job's
        "ft:tiny:suffix:job_0123abc:ckpt-step-4",
        "ft:tiny:a/b:s:train:0",  # a name with '/'
        "ft::n:s:train:0",
        TINY,
    ):
        assert read_sampler_model_name(other) is None, other


def test_sampler_saves_are_listed_and_resolve_by_name_and_path(api: Api) -> None:
    _, model_id = _client(api)
    _save(api.settings, api.project_id, model_id, "sampler_weights", "first")
    _save(api.settings, api.project_id, model_id, "sampler_weights", "second")
    _save(api.settings, api.project_id, model_id, "weights", "state")  # not a model
    listed = api.client.get("/v1/models", headers=api.headers).json()["data"]
    names = [m["id"] for m in listed]
    second, first = (sampler_model_name(TINY, model_id, n) for n in ("second", "first"))
    assert names[: len(PACKAGED_MODELS) + 2] == [*PACKAGED_MODELS, second, first]  # newest first
    assert len(names) == len(PACKAGED_MODELS) + 2
    shown = listed[len(PACKAGED_MODELS)]
    path = f"tinker://{model_id}/sampler_weights/second"
    assert shown["grpo_service"] == {
        "kind": "lora", "job_id": None, "step": None, "tinker_path": path,
    }  # fmt: skip
    assert shown["parent"] == TINY and shown["owned_by"] == api.project_id
    for name in (second, path):
        found = _get(api, name)
        assert found.status_code == 200, found.text
        assert found.json()["id"] == name and found.json()["grpo_service"]["tinker_path"] == path

    other_key, _ = api.new_key()
    assert second not in [
        m["id"]
        for m in api.client.get(
            "/v1/models", headers={"Authorization": f"Bearer {other_key}"}
        ).json()["data"]
    ]
    unusable = [
        (second, other_key),  # another project's
        (path, other_key),
        (f"tinker://{model_id}/weights/state", None),  # a state save
        (sampler_model_name("SmolLM2-135M-Instruct", model_id, "second"), None),  # wrong base
        (sampler_model_name(TINY, model_id, "missing"), None),
        (sampler_model_name(TINY, model_id.replace(":0", ":9"), "second"), None),
    ]
    for name, key in unusable:
        answer = _get(api, name, key)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_an_expired_save_is_gone(api: Api) -> None:
    _, model_id = _client(api)
    past = utcnow() - timedelta(seconds=1)
    _save(api.settings, api.project_id, model_id, "sampler_weights", "old", expires_at=past)
    assert _get(api, sampler_model_name(TINY, model_id, "old")).status_code == 404
    names = [m["id"] for m in api.client.get("/v1/models", headers=api.headers).json()["data"]]
    assert names == list(PACKAGED_MODELS)


def test_the_gateway_asks_for_the_adapters_over_the_base_and_an_overwrite_is_new(
    api: Api,
) -> None:
    _, model_id = _client(api)
    _save(api.settings, api.project_id, model_id, "sampler_weights", "s")
    name = sampler_model_name(TINY, model_id, "s")

    def ensure() -> Any:
        engine = make_engine(api.settings.resolved_database_url)
        try:
            with session_scope(make_session_factory(engine)) as db:
                model = resolve_model(db, project_id=api.project_id, name=name)
                return routing.ensure_request(db, project_id=api.project_id, model=model)
        finally:
            engine.dispose()

    first = ensure()
    assert first.base_model == TINY and first.full is None and first.base_weights is None
    assert isinstance(first.adapter, SamplerWeightsRef)
    assert (first.adapter.project_id, first.adapter.model_id, first.adapter.name) == (
        api.project_id, model_id, "s",
    )  # fmt: skip
    _save(
        api.settings, api.project_id, model_id, "sampler_weights", "s",
        now=utcnow() + timedelta(seconds=5),
    )  # fmt: skip
    again = ensure()
    assert served_name(again.adapter) != served_name(first.adapter)


def test_a_client_named_by_an_alias_is_served_on_its_packaged_model(settings: Settings) -> None:
    aliased = settings.model_copy(
        update={"tinker_model_aliases": f"meta-llama/Llama-3.2-1B={TINY}"}
    )
    key, project_id = new_project_key(aliased)
    with TestClient(create_app(aliased)) as client:
        tinker = Tinker(client, aliased, "tml-" + key)
        served = tinker.client.get(
            "/api/v1/get_server_capabilities", headers={"X-API-Key": tinker.key}
        )
        assert "meta-llama/Llama-3.2-1B" in [
            m["model_name"] for m in served.json()["supported_models"]
        ]
        made = tinker.post(
            "create_model",
            {"session_id": tinker.session(), "model_seq_id": 0,
             "base_model": "meta-llama/Llama-3.2-1B", "lora_config": {"rank": 4}},
        )  # fmt: skip
        assert made.status_code == 200, made.text
        model_id = made.json()["model_id"]
        _save(aliased, project_id, model_id, "sampler_weights", "s")
        name = sampler_model_name("meta-llama/Llama-3.2-1B", model_id, "s")
        listed = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
        shown = {m["id"]: m for m in listed["data"]}[name]
        assert shown["parent"] == "meta-llama/Llama-3.2-1B"
    engine = make_engine(aliased.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            model = resolve_model(db, project_id=project_id, name=name)
            ensure = routing.ensure_request(db, project_id=project_id, model=model)
    finally:
        engine.dispose()
    assert ensure.base_model == TINY  # the engine of the packaged model, the adapters on it
    # Unknown targets are refused when the settings are built.
    with pytest.raises(ValidationError):
        settings.model_validate({**settings.model_dump(), "tinker_model_aliases": "a=not-packaged"})
