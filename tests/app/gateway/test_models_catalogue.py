"""GET /v1/models and /v1/models/{model}: the packaged base models and the project's fine-tuned
models and checkpoints, in OpenAI's shapes; every name form resolves, and every name the
project cannot use (another project's, a deleted job's, a pruned checkpoint's, an unknown one)
is the same 404 `model_not_found`. The real `openai` SDK reads both routes unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import openai
import pytest
from openai import OpenAI
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.errors import ModelNotFound
from app.core.settings import Settings
from app.gateway.schemas import MAX_MODEL_NAME
from app.gateway.service import CHECKPOINTS_PER_JOB, resolve_model
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.progress import repository as progress_repo
from grpo_cli.download import parse_model_name
from jobspec import PACKAGED_MODELS
from tests.app.fine_tuning.test_fine_tuning_api import ROWS, STRING_CHECK, create, request, upload
from tests.conftest import Api, new_project_key, settings_for, tiny_spec
from tests.live_server import serve


@contextmanager
def _db(settings: Settings) -> Iterator[Session]:
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


def _job(api: Api, **spec: Any) -> str:
    response = api.client.post("/v1/jobs", json={**tiny_spec(), **spec}, headers=api.headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _train(settings: Settings, job_id: str, steps: Sequence[int], *, succeed: bool) -> None:
    """What a worker records: the job runs, saves checkpoints at `steps`, maybe succeeds."""
    with _db(settings) as session:
        transitions.transition(session, job_id, JobStatus.RUNNING)
    with _db(settings) as session:
        for step in steps:
            progress_repo.add_checkpoint_once(
                session,
                job_id=job_id,
                step=step,
                attempt=1,
                path=settings.resolved_checkpoint_dir / job_id / f"checkpoint-{step:06d}",
                now=utcnow(),
            )
    if succeed:
        with _db(settings) as session:
            transitions.transition(session, job_id, JobStatus.SUCCEEDED)


def _ft(job_id: str, model: str = "tiny-random-llama", suffix: str = "") -> str:
    return f"ft:{model}:{suffix}:{job_id}"


def _get(api: Api, name: str, headers: dict[str, str] | None = None) -> Any:
    return api.client.get(f"/v1/models/{quote(name, safe='')}", headers=headers or api.headers)


def _model(api: Api, name: str) -> dict[str, Any]:
    response = _get(api, name)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _not_found(response: Any, name: str) -> None:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"The model {name!r} does not exist or you do not have access to it."
    )


def _ids(api: Api, headers: dict[str, str] | None = None, **params: Any) -> list[str]:
    response = api.client.get("/v1/models", params=params, headers=headers or api.headers)
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


def test_the_list_holds_the_base_models_and_the_projects_own_names(api: Api) -> None:
    done = _job(api)
    _train(api.settings, done, [2, 4], succeed=True)
    running = _job(api, lora={"rank": 4})
    _train(api.settings, running, [1], succeed=False)
    _job(api)  # queued: no weights yet, nothing listed
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    theirs = api.client.post("/v1/jobs", json=tiny_spec(), headers=other).json()["id"]
    _train(api.settings, theirs, [3], succeed=True)

    listed = api.client.get("/v1/models", headers=api.headers).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [m["id"] for m in listed["data"]] == [
        *PACKAGED_MODELS,
        f"{_ft(running)}:ckpt-step-1",  # newest job first; a running job's checkpoints too
        _ft(done),
        f"{_ft(done)}:ckpt-step-4",
        f"{_ft(done)}:ckpt-step-2",
    ]
    by_id = {m["id"]: m for m in listed["data"]}
    base = by_id[PACKAGED_MODELS[0]]
    assert base["object"] == "model" and base["owned_by"] == "system"
    assert base["parent"] is None and base["grpo_service"]["kind"] == "base"
    final = by_id[_ft(done)]
    assert final["owned_by"] == api.project_id and final["parent"] == "tiny-random-llama"
    assert final["grpo_service"] == {"kind": "full", "job_id": done, "step": 4, "tinker_path": None}
    assert isinstance(final["created"], int) and final["created"] > 0
    adapter = by_id[f"{_ft(running)}:ckpt-step-1"]
    assert adapter["grpo_service"] == {
        "kind": "lora",
        "job_id": running,
        "step": 1,
        "tinker_path": None,
    }
    assert adapter["parent"] == "tiny-random-llama"
    assert all(theirs not in m["id"] for m in listed["data"])
    assert f"{_ft(theirs)}:ckpt-step-3" in _ids(api, headers=other)


def test_every_name_form_resolves(api: Api) -> None:
    done = _job(api)
    _train(api.settings, done, [2, 4], succeed=True)
    running = _job(api)
    _train(api.settings, running, [1, 3], succeed=False)

    for name, step in [
        (_ft(done), 4),
        (f"{_ft(done)}:ckpt-step-2", 2),
        (done, 4),
        (f"{done}@2", 2),
        (f"{_ft(running)}:ckpt-step-3", 3),  # usable while the job still runs
        (f"{running}@1", 1),
    ]:
        got = _model(api, name)
        assert got["id"] == name and got["object"] == "model"
        assert got["grpo_service"]["step"] == step, name
        assert got["owned_by"] == api.project_id
    for name in PACKAGED_MODELS:
        got = _model(api, name)
        assert got["id"] == name and got["owned_by"] == "system"
    # The final weights exist only once the job has succeeded.
    _not_found(_get(api, _ft(running)), _ft(running))
    _not_found(_get(api, running), running)
    # The CLI's reader of these names agrees with the catalogue's.
    assert parse_model_name(_ft(done)) == (done, None)
    assert parse_model_name(f"{_ft(done)}:ckpt-step-2") == (done, 2)


def test_the_resolver_says_what_would_serve_a_name(api: Api) -> None:
    """What the inference tier will read: the kind, the base to load, the checkpoint (by step
    and folder name, never a server path) and, for adapters trained on a fine-tune, its
    checkpoint."""
    full = _job(api)
    _train(api.settings, full, [2, 4], succeed=True)
    adapters = _job(api, lora={"rank": 4}, init_from={"job_id": full, "step": 4})
    _train(api.settings, adapters, [3], succeed=False)
    with _db(api.settings) as session:
        final = resolve_model(session, project_id=api.project_id, name=full)
        checkpoint = resolve_model(session, project_id=api.project_id, name=f"{adapters}@3")
        base = resolve_model(session, project_id=api.project_id, name=PACKAGED_MODELS[0])
    assert (final.kind, final.base_model, final.job_id, final.step) == (
        "full",
        "tiny-random-llama",
        full,
        4,
    )
    assert final.checkpoint_folder == "checkpoint-000004" and final.base_checkpoint is None
    assert (checkpoint.kind, checkpoint.step, checkpoint.checkpoint_folder) == (
        "lora",
        3,
        "checkpoint-000003",
    )
    assert checkpoint.base_checkpoint == (full, 4)
    assert (base.kind, base.base_model, base.job_id, base.step) == (
        "base",
        PACKAGED_MODELS[0],
        None,
        None,
    )
    with _db(api.settings) as session, pytest.raises(ModelNotFound):
        resolve_model(session, project_id=api.new_key()[1], name=full)


def test_an_openai_job_is_named_with_its_requested_model_and_suffix(api: Api) -> None:
    file = upload(api, ROWS)
    job = create(api, request(file["id"], suffix="cat")).json()
    _train(api.settings, job["id"], [1], succeed=True)
    got = api.client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=api.headers).json()
    name = got["fine_tuned_model"]
    assert name == _ft(job["id"], suffix="cat") and name in _ids(api)
    assert _model(api, name)["grpo_service"]["job_id"] == job["id"]
    # Only the job's own name resolves: another model or suffix in front of its id does not.
    for wrong in (_ft(job["id"]), _ft(job["id"], model="smollm2-135m-instruct", suffix="cat")):
        _not_found(_get(api, wrong), wrong)


def test_names_the_project_cannot_use_are_one_404(api: Api) -> None:
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    theirs = api.client.post("/v1/jobs", json=tiny_spec(), headers=other).json()["id"]
    _train(api.settings, theirs, [1, 2], succeed=True)
    deleted = _job(api)
    _train(api.settings, deleted, [1], succeed=True)
    assert _get(api, deleted).status_code == 200
    gone = api.client.delete(f"/v1/jobs/{deleted}", headers=api.headers)
    assert gone.status_code == 200, gone.text
    pruned = _job(api)
    _train(api.settings, pruned, [1, 2], succeed=True)
    with _db(api.settings) as session:
        checkpoints_repo.mark_deleted(session, job_id=pruned, steps=[1], now=utcnow())

    for name in [
        _ft(theirs),
        f"{_ft(theirs)}:ckpt-step-2",
        theirs,
        f"{theirs}@1",
        _ft(deleted),
        deleted,
        f"{_ft(pruned)}:ckpt-step-1",
        f"{pruned}@1",
        f"{_ft(pruned)}:ckpt-step-7",  # never saved
        "job_0123456789abcdef",
        "ft:tiny-random-llama::job_0123456789abcdef",
        "gpt-4o",
        "o4-mini",  # an OpenAI name the fine-tuning API maps: not a servable model
        "ft:",
        "ft:x:y:job_a:ckpt-step-99999999999999999999",
        f"{pruned}@",
        f"{pruned}@-1",
    ]:
        _not_found(_get(api, name), name)
    assert _model(api, f"{pruned}@2")["grpo_service"]["step"] == 2  # the kept one still does
    listed = _ids(api)
    assert f"{_ft(pruned)}:ckpt-step-1" not in listed and all(deleted not in i for i in listed)
    # The owner still sees its own.
    assert _get(api, _ft(theirs), headers=other).status_code == 200


def test_malformed_names_are_a_4xx_naming_the_model(api: Api) -> None:
    for path in (
        f"/v1/models/{'a' * (MAX_MODEL_NAME + 1)}",
        "/v1/models/job_ab%00cd",
        "/v1/models/",
    ):
        response = api.client.get(path, headers=api.headers)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "model", response.text
    assert _get(api, "a" * MAX_MODEL_NAME).status_code == 404
    bad = api.client.get("/v1/models", params={"limit": 0}, headers=api.headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_the_list_pages_by_job_and_bounds_each_jobs_checkpoints(api: Api) -> None:
    older = _job(api)
    steps = list(range(1, CHECKPOINTS_PER_JOB + 3))
    _train(api.settings, older, steps, succeed=True)
    newer = _job(api)
    _train(api.settings, newer, [5], succeed=False)

    first = api.client.get("/v1/models", params={"limit": 1}, headers=api.headers).json()
    assert [m["id"] for m in first["data"]] == [*PACKAGED_MODELS, f"{_ft(newer)}:ckpt-step-5"]
    assert first["has_more"] is True and first["next_after"] == newer
    second = api.client.get(
        "/v1/models", params={"limit": 1, "after": newer}, headers=api.headers
    ).json()
    newest = sorted(steps, reverse=True)[:CHECKPOINTS_PER_JOB]
    assert [m["id"] for m in second["data"]] == [
        _ft(older),
        *(f"{_ft(older)}:ckpt-step-{s}" for s in newest),
    ]
    assert second["has_more"] is False and second["next_after"] is None
    assert _model(api, f"{_ft(older)}:ckpt-step-1")["grpo_service"]["step"] == 1  # not listed


@pytest.fixture
def sdk_settings(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Settings:
    """An operator map whose OpenAI name holds a '/', as a Hub repo id does: the SDK sends it
    inside the path as %2F."""
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    return settings_for(
        backend, url, sqlite_dir, queue_name, openai_models={"org/base-1": "tiny-random-llama"}
    )


class _NoDispatch:
    def send(self, job_id: str, queue: str | None = None) -> bool:
        return True


def test_the_openai_sdk_lists_and_retrieves_models(sdk_settings: Settings) -> None:
    with serve(sdk_settings, _NoDispatch()) as server:

        def client() -> OpenAI:
            key, _ = new_project_key(sdk_settings)
            return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)

        mine, theirs = client(), client()
        content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        file = mine.files.create(file=("train.jsonl", content), purpose="fine-tune")
        job = mine.fine_tuning.jobs.create(
            model="org/base-1",
            training_file=file.id,
            suffix="sdk",
            method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}},
            extra_body={"grpo_service": {"rollout": {"engine": "transformers"}}},
        )
        _train(sdk_settings, job.id, [1, 2], succeed=True)
        name = mine.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
        assert name is not None and name.startswith("ft:org/base-1:")

        listed = mine.models.list()
        ids = [m.id for m in listed]
        assert ids[: len(PACKAGED_MODELS)] == list(PACKAGED_MODELS)
        assert name in ids and f"{name}:ckpt-step-2" in ids
        got = mine.models.retrieve(name)
        assert got.id == name and got.object == "model" and got.owned_by != "system"
        assert got.model_extra is not None and got.model_extra["parent"] == "org/base-1"
        assert mine.models.retrieve(f"{name}:ckpt-step-1").id == f"{name}:ckpt-step-1"
        assert mine.models.retrieve(PACKAGED_MODELS[0]).owned_by == "system"

        assert name not in [m.id for m in theirs.models.list()]
        with pytest.raises(openai.NotFoundError) as caught:
            theirs.models.retrieve(name)
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
