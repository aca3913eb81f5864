"""A job whose `model` is a Hub repo id, through worker.runner.run_job on the real database: the
worker checks the operator's Hub rule again, resolves the id in its own Hugging Face cache
(offline: HF_HUB_OFFLINE=1, HF_HOME under tmp_path; a hub-cache layout built by
tests/hub_cache.py) and hands the trainer the snapshot folder; a model that is not cached fails
the job with a message naming it and how to pre-fetch it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.db import make_engine, make_session_factory
from app.core.settings import Settings
from jobspec import JobSpec
from tests.conftest import RecordingDispatcher, tiny_spec
from tests.hub_cache import add_snapshot
from tests.worker.test_runner import FakeResult, fake_trainer, job, make_job
from trainer.run.callbacks import Callbacks
from worker.context import WorkerContext
from worker.runner import run_job
from worker.settings import build_worker_settings

REPO = "tiny-org/Tiny-Llama-2L"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The worker's (empty) Hugging Face cache; the worker is offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return tmp_path / "hf-home" / "hub"


def _ctx(settings: Settings, tmp_path: Path, **extra: object) -> WorkerContext:
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        checkpoint_dir=tmp_path / "checkpoints",
        worker_name="hub-runner-under-test",
        max_attempts=2,
        db_retry_seconds=1,
        **extra,
    )
    engine = make_engine(worker_settings.resolved_database_url)
    return WorkerContext(worker_settings, make_session_factory(engine), RecordingDispatcher())


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> WorkerContext:
    return _ctx(settings, tmp_path)


def _fake_model(folder: Path) -> Path:
    """Enough of a model folder for the worker's checks (the fake trainer loads nothing)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_a_cached_hub_model_is_trained_from_its_snapshot(
    ctx: WorkerContext, hub: Path, tmp_path: Path
) -> None:
    source = _fake_model(tmp_path / "source")
    main = add_snapshot(hub, REPO, source, COMMIT_A, branches=["main"])
    tagged = add_snapshot(hub, REPO, source, COMMIT_B, branches=["v2"])
    for revision, snapshot in ((None, main), ("v2", tagged), (COMMIT_A, main)):
        calls: list[dict[str, Any]] = []
        spec = tiny_spec(steps=1) | {"model": REPO, "model_revision": revision}
        job_id = make_job(ctx, spec)
        assert run_job(ctx, job_id, train=fake_trainer(1, calls=calls)) == "succeeded"
        opened = calls[0]["spec"]
        assert opened.model == str(snapshot) and opened.model_revision is None


def test_an_uncached_hub_model_fails_the_job_saying_how_to_prefetch_it(
    ctx: WorkerContext, hub: Path, tmp_path: Path
) -> None:
    add_snapshot(hub, REPO, _fake_model(tmp_path / "source"), COMMIT_A)

    def never_called(spec: JobSpec, callbacks: Callbacks, **_: object) -> FakeResult:
        raise AssertionError("an uncached model must not reach the trainer")

    for model, revision in (("nobody/not-cached", None), (REPO, "no-such-branch")):
        job_id = make_job(ctx, tiny_spec(steps=1) | {"model": model, "model_revision": revision})
        assert run_job(ctx, job_id, train=never_called) == "failed"
        final = job(ctx, job_id)
        assert final.error_code == "model_not_cached"
        message = final.error_message or ""
        rev = revision or "main"
        assert f"model {model} (revision {rev})" in message
        assert f"hf download {model} --revision {rev}" in message
        assert str(tmp_path) not in message


def test_a_hub_model_the_operator_does_not_allow_fails_before_it_is_looked_up(
    settings: Settings, hub: Path, tmp_path: Path
) -> None:
    # Submitted under one configuration, run by a worker whose operator narrowed it since.
    source = _fake_model(tmp_path / "source")
    add_snapshot(hub, REPO, source, COMMIT_A)
    add_snapshot(hub, "Qwen/Qwen2.5-0.5B-Instruct", source, COMMIT_A)
    for extra in ({"allow_hub_models": False}, {"hub_model_allowlist": "Qwen"}):
        ctx = _ctx(settings, tmp_path, **extra)
        job_id = make_job(ctx, tiny_spec(steps=1) | {"model": REPO})
        assert run_job(ctx, job_id, train=fake_trainer(1)) == "failed"
        assert job(ctx, job_id).error_code == "model_not_allowed"
    allowed = _ctx(settings, tmp_path, hub_model_allowlist="Qwen")
    job_id = make_job(allowed, tiny_spec(steps=1) | {"model": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert run_job(allowed, job_id, train=fake_trainer(1)) == "succeeded"


# One store: it is not what this tests (test_round_trip runs jobs on both).
@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.model
def test_a_hub_model_trains_through_the_real_trainer(
    ctx: WorkerContext, hub: Path, tmp_path: Path
) -> None:
    from trainer.models.loading import resolve_model

    # The packaged tiny Llama, laid out as `hf download` leaves a repo, then a real 1-step job.
    add_snapshot(hub, REPO, resolve_model("tiny-random-llama", tmp_path / "models"), COMMIT_A)
    job_id = make_job(ctx, tiny_spec(steps=1) | {"model": REPO, "checkpoint_interval": 0})
    assert run_job(ctx, job_id) == "succeeded", job(ctx, job_id).error_message
    assert job(ctx, job_id).status == "succeeded"
