"""A Tinker client's saves and the project's storage (on Postgres and on the embedded SQLite),
through the worker's own save function with folders standing in for a model's (no model runs):

- a save that would take the project's checkpoints and Tinker saves past
  GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT is refused before it is put in place, naming the
  numbers; overwriting a save frees the old one's bytes; GET /v1/usage counts the saves;
- RestClient.delete_checkpoint's route makes a save disappear at once (404 for another project,
  or twice), and the maintenance clean-up then removes its folder and row, as it does for a
  save past its TTL."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.tinker_tables import TinkerCheckpoint
from app.tinker import worker_repository as q
from tests.app.tinker.test_tinker_api import Tinker
from tests.conftest import Api
from worker.settings import WorkerSettings, build_worker_settings
from worker.tinker_saves import RequestRefused, remove_expired_saves, write_save

KIB = 1024


def _worker(api: Api, **overrides: Any) -> tuple[WorkerSettings, sessionmaker[Session]]:
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
        **overrides,
    )
    return ws, make_session_factory(make_engine(ws.resolved_database_url))


def _writes(size: int) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"\0" * size)

    return write


def _ref(api: Api) -> tuple[Tinker, q.ModelRef]:
    tinker = Tinker(api.client, api.settings, "tml-" + api.key)
    session_id = tinker.session()
    model_id = tinker.model(session_id)
    return tinker, q.ModelRef(model_id, session_id, api.project_id, "tiny-random-llama", "w1")


def _save(
    ws: WorkerSettings, sessions: Any, ref: q.ModelRef, name: str, size: int, **kw: Any
) -> str:
    return write_save(
        sessions, ws, ref, "sampler_weights", name, _writes(size),
        overwrite=kw.get("overwrite", True), ttl_seconds=kw.get("ttl"), user_metadata=None,
    )  # fmt: skip


def test_saves_count_against_the_projects_storage_limit(api: Api) -> None:
    ws, sessions = _worker(api, max_checkpoint_bytes_per_project=100 * KIB)
    _, ref = _ref(api)
    _save(ws, sessions, ref, "a", 60 * KIB)
    folder = ws.resolved_checkpoint_dir / "tinker" / api.project_id
    with pytest.raises(RequestRefused) as refused:
        _save(ws, sessions, ref, "b", 60 * KIB)
    message = str(refused.value)
    assert "GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT" in message and "100.00 KiB" in message
    assert not any(p.name.startswith(("b", ".b")) for p in folder.rglob("*"))  # nothing left
    # Writing "a" again frees its old bytes: 70 KiB in place of 60 fits.
    _save(ws, sessions, ref, "a", 70 * KIB)
    usage = api.client.get("/v1/usage", headers=api.headers).json()
    assert usage["checkpoint_quota"]["used_bytes"] >= 70 * KIB


def test_a_deleted_or_expired_save_is_gone_then_removed(api: Api) -> None:
    ws, sessions = _worker(api)
    tinker, ref = _ref(api)
    path = _save(ws, sessions, ref, "kept", 1 * KIB)
    _save(ws, sessions, ref, "doomed", 1 * KIB)
    _save(ws, sessions, ref, "brief", 1 * KIB, ttl=60)
    base = f"/api/v1/training_runs/{ref.id}/checkpoints"
    headers = {"X-API-Key": tinker.key}
    other = Tinker(api.client, api.settings)
    refused = other.client.delete(
        f"{base}/sampler_weights/doomed", headers={"X-API-Key": other.key}
    )
    assert refused.status_code == 404
    for hostile in ("weights/../../doomed", "sampler_weights/../kept", "nope/kept", "kept", ""):
        answer = api.client.delete(f"{base}/{hostile}", headers=headers)
        assert answer.status_code in (404, 405), (hostile, answer.status_code)
    assert api.client.delete(f"{base}/sampler_weights/doomed", headers=headers).status_code == 204
    assert api.client.delete(f"{base}/sampler_weights/doomed", headers=headers).status_code == 404
    listed = api.client.get(base, headers=headers).json()["checkpoints"]
    assert sorted(c["checkpoint_id"] for c in listed) == [
        "sampler_weights/brief",
        "sampler_weights/kept",
    ]
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            row = db.get(TinkerCheckpoint, (ref.id, "sampler_weights", "brief"))
            assert row is not None
            row.expires_at = utcnow() - timedelta(seconds=1)
    finally:
        engine.dispose()

    # (The test database is shared: other tests' expired saves may go in the same pass.)
    assert remove_expired_saves(sessions, ws.resolved_checkpoint_dir) >= 2
    saves = ws.resolved_checkpoint_dir / "tinker" / api.project_id / ref.id.replace(":", "_")
    assert sorted(p.name for p in (saves / "sampler_weights").iterdir()) == ["kept"]
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            left = [n for n in ("kept", "doomed", "brief")
                    if db.get(TinkerCheckpoint, (ref.id, "sampler_weights", n)) is not None]  # fmt: skip
    finally:
        engine.dispose()
    assert left == ["kept"]
    assert path.endswith("/sampler_weights/kept")
