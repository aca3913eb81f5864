"""A Tinker training client shares its worker (issue 44): an idle one is written to disk and
released, and its next call continues where it was; a worker that also serves jobs lets a
waiting job go first; a project's clients are held by a bounded number of workers; the
maintenance sends waiting clients again, closes released ones whose session ended and bounds
the stored calls. In process, against the real Postgres test database (worker.tinker_model,
worker.tinker_upkeep)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest
from app.tinker import service, storage
from tests.conftest import wait_until
from tests.worker.test_tinker_model import (
    Client,
    Holder,
    fwdbwd,
    fwdbwd_output,
    new_client,
    other_worker,
    worker_context,
)
from worker import tinker_upkeep
from worker.context import WorkerContext

DATA = [
    ([2, 10, 11, 12, 13], {"target_tokens": [10, 11, 12, 13, 3], "weights": [0.0, 1, 1, 1, 1]}),
    ([2, 20, 21], {"target_tokens": [20, 21, 3], "weights": [0.0, 1, 1]}),
]
ADAM = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


@pytest.fixture
def backend() -> str:
    return "postgres"


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> Iterator[WorkerContext]:
    yield from worker_context(settings, tmp_path)


@pytest.fixture
def client(ctx: WorkerContext) -> Client:
    return new_client(ctx)


def tuned(ctx: WorkerContext, name: str, **settings: Any) -> WorkerContext:
    """Another worker of the same deployment (its own name), with ``settings`` changed."""
    other = other_worker(ctx, name)
    other.settings = other.settings.model_copy(update=settings)
    return other


def optim(model_id: str) -> dict[str, Any]:
    return {"model_id": model_id, "adam_params": ADAM, "type": "optim_step"}


def accept(client: Client, model_id: str, seq: int, kind: str, body: bytes) -> str:
    """A call stored as the API stores it (app.tinker.service.accept_request): a released
    model goes back to the queue with it."""
    with session_scope(client.ctx.sessions) as db:
        model = db.get(TinkerModel, model_id)
        assert model is not None
        row = service.accept_request(db, client.ctx.settings, model, f"api-{seq}", kind, body)
        return row.request_id


def status(client: Client, model_id: str) -> str:
    return client.model_row(model_id).status


@pytest.mark.model
def test_an_idle_client_is_released_and_its_next_call_continues_where_it_was(
    ctx: WorkerContext,
) -> None:
    idle = tuned(ctx, "tinker-idle", tinker_idle_release_s=5)
    released, resident = new_client(idle), new_client(ctx)
    outcomes = {}
    for client, worker in ((released, idle), (resident, ctx)):
        model = client.model()
        calls = [
            client.call(model, "create_model", {"type": "create_model"}),
            client.call(model, "forward_backward", fwdbwd(model, DATA)),
            client.call(model, "optim_step", json.dumps(optim(model)).encode()),
            # Gradients accumulated and not applied when the client goes quiet.
            client.call(model, "forward_backward", fwdbwd(model, DATA)),
        ]
        holder = Holder(worker, model)
        client.settled(*calls)
        outcomes[model] = (client, worker, holder)
    (model_a, (client_a, worker_a, holder_a)), (model_b, (client_b, _, _)) = outcomes.items()

    # Quiet for GRPO_TINKER_IDLE_RELEASE_S: written to disk, the worker's task ends.
    wait_until(lambda: status(client_a, model_a) == "released", 60, "the idle release")
    assert holder_a.result() == "released"
    idle_state = client_a.model_row(model_a).idle_state
    assert idle_state is not None and Path(idle_state).is_dir()
    assert not worker_a.held_tinker_models
    assert status(client_b, model_b) == "ready"  # the other worker's default: 180 s

    # Its next call sends it to the queue again; a worker loads it where it was.
    first = accept(client_a, model_a, 1, "optim_step", json.dumps(optim(model_a)).encode())
    assert status(client_a, model_a) == "starting"
    Holder(worker_a, model_a)
    second = accept(client_a, model_a, 2, "forward", fwdbwd(model_a, DATA, forward_only=True))
    step_b = client_b.call(model_b, "optim_step", json.dumps(optim(model_b)).encode())
    after_b = client_b.call(model_b, "forward", fwdbwd(model_b, DATA, forward_only=True))
    done = client_a.settled(first, second) + client_b.settled(step_b, after_b)
    assert all(row.status == "done" for row in done), [row.error for row in done]
    a, b = (fwdbwd_output(row.result or b"")[0] for row in (done[1], done[3]))
    assert a == b  # the same log-probabilities as the client that stayed resident
    assert status(client_a, model_a) == "ready"
    client_a.finish_session()
    client_b.finish_session()


def test_a_worker_consumes_the_queues_of_what_it_serves_jobs_first(
    ctx: WorkerContext,
) -> None:
    base = ctx.settings.queue_name
    served = {
        serves: tuned(ctx, f"w-{serves}", worker_serves=serves).settings.consumed_queues
        for serves in ("both", "jobs", "tinker")
    }
    assert served == {
        "both": [base, f"{base}-tinker"],
        "jobs": [base],
        "tinker": [f"{base}-tinker"],
    }
    custom = tuned(ctx, "w-custom", tinker_queue="tinker-pool", worker_devices=2)
    assert custom.settings.consumed_queues == [f"{base}-2dev", "tinker-pool"]


def test_a_projects_clients_are_held_by_at_most_its_bound_of_workers(
    ctx: WorkerContext, client: Client
) -> None:
    bounded = tuned(ctx, "tinker-bounded", tinker_max_workers_per_project=1)
    # The project's first client is held by another worker, alive.
    client.model(0, status="ready", lease_owner="elsewhere", heartbeat_at=utcnow())
    second = client.model(1)
    client.call(second, "create_model", {"type": "create_model"})
    assert Holder(bounded, second).result() == "not_claimed"
    assert client.model_row(second).lease_owner is None  # the project's worker adopts it


def test_the_sweep_sends_a_waiting_client_again(
    ctx: WorkerContext, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    monkeypatch.setattr(
        tinker_upkeep, "send_model", lambda _s, model_id: sent.append(model_id) or True
    )
    old = utcnow() - timedelta(seconds=tinker_upkeep.RESEND_AFTER_S + 1)
    waiting = client.model(0, dispatched_at=old)
    fresh = client.model(1, dispatched_at=utcnow())
    held = client.model(2, dispatched_at=old, lease_owner="w", heartbeat_at=utcnow())
    assert waiting in tinker_upkeep.resend_waiting_models(ctx)
    assert fresh not in sent and held not in sent
    dispatched = client.model_row(waiting).dispatched_at
    assert dispatched is not None and dispatched > old


def test_a_released_client_of_an_ended_session_is_closed_and_its_folder_removed(
    ctx: WorkerContext, client: Client, tmp_path: Path
) -> None:
    folder = tmp_path / "checkpoints" / "idle-state" / "idle" / "abc"
    folder.mkdir(parents=True)
    model = client.model(status="released", idle_state=str(folder))
    # (Other tests' rows share the database: the pass may close theirs too.)
    assert model not in tinker_upkeep.close_released_of_ended_sessions(ctx)  # the session lives
    client.finish_session()
    assert model in tinker_upkeep.close_released_of_ended_sessions(ctx)
    row = client.model_row(model)
    assert (row.status, row.idle_state) == ("closed", None)
    assert not folder.exists()


def drained(ctx: WorkerContext) -> tuple[int, int]:
    """Upkeep passes until one does nothing; (results dropped, rows deleted) in all."""
    dropped = deleted = 0
    for _ in range(100):
        results, rows = tinker_upkeep.bound_stored_calls(ctx)
        if (results, rows) == (0, 0):
            return dropped, deleted
        dropped, deleted = dropped + results, deleted + rows
    raise AssertionError("the upkeep never ran out of work")


def test_stored_calls_are_bounded(ctx: WorkerContext, client: Client) -> None:
    model = client.model(status="ready")
    read, unread, fresh = (client.call(model, "optim_step", b"x" * 1000) for _ in range(3))
    long_ago = utcnow() - timedelta(seconds=ctx.settings.tinker_result_retention_s + 1)
    with session_scope(ctx.sessions) as db:
        for request_id, finished, retrieved in (
            (read, utcnow(), utcnow() - timedelta(seconds=storage.RESULT_GRACE_S + 1)),
            (unread, long_ago, None),
            (fresh, utcnow(), utcnow()),
        ):
            row = db.query(TinkerRequest).filter_by(request_id=request_id).one()
            row.status, row.body, row.result = "done", None, b"r" * 500
            row.stored_bytes, row.finished_at, row.retrieved_at = 500, finished, retrieved
    # Other tests' rows share the database: passes until nothing is left to do (each pass
    # handles a batch), then this project's rows are looked at.
    assert drained(ctx)[0] >= 2
    assert client.request(read).result is None and client.request(unread).result is None
    assert client.request(fresh).result == b"r" * 500  # read a moment ago: kept a while
    assert client.request(read).stored_bytes == 0
    # The rows of a session that ended longer ago than the retention are deleted.
    client.age_session(
        ctx.settings.tinker_session_ttl_s + ctx.settings.tinker_result_retention_s + 5
    )
    assert drained(ctx)[1] >= 3
    with session_scope(ctx.sessions) as db:
        assert db.query(TinkerRequest).filter_by(model_id=model).count() == 0
