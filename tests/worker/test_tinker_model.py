"""worker.tinker_model.hold_tinker_model in process, against the real Postgres test database:
the claim and its fence, a failed load, the session's end, a lost lease and a worker's
shutdown. The calls themselves (training, saves, sampling) are in test_tinker_model_calls.py,
which uses the helpers below (rows as the API inserts them, bodies as the SDK sends them)."""

from __future__ import annotations

import itertools
import json
import threading
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest, TinkerSampler, TinkerSession
from app.tinker.proto import ForwardBackwardOutputPb, SampleResponsePb
from app.tinker.wire import FwdBwdRequest, WireDatum, encode_forward_backward
from app.tinker.worker_repository import ModelRef
from tests.conftest import RecordingDispatcher, new_project_key, wait_until
from worker import tinker_requests
from worker.context import WorkerContext
from worker.settings import build_worker_settings
from worker.tinker_model import ADOPT_OTHERS_AFTER_S, _adopt_waiting, hold_tinker_model

TINY = "tiny-random-llama"


@pytest.fixture
def backend() -> str:
    # The worker's fenced updates are plain SQL; Postgres is where its concurrency matters.
    return "postgres"


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> Iterator[WorkerContext]:
    yield from worker_context(settings, tmp_path)


def worker_context(settings: Settings, tmp_path: Path) -> Iterator[WorkerContext]:
    """A worker's context on the test database; at the end, every model it holds is let go
    (a warm shutdown) before the database goes."""
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        checkpoint_dir=tmp_path / "checkpoints",
        worker_name="tinker-under-test",
        heartbeat_seconds=0.2,
    )
    engine = make_engine(worker_settings.resolved_database_url)
    context = WorkerContext(worker_settings, make_session_factory(engine), RecordingDispatcher())
    yield context
    context.shutdown.set()
    for holder in Holder.started:
        holder.result()
    Holder.started.clear()
    engine.dispose()


@dataclass
class Client:
    """One Tinker session of a fresh project, its rows written as the API writes them."""

    ctx: WorkerContext
    project_id: str
    session_id: str
    seq: dict[str, int] = field(default_factory=dict)

    def model(self, n: int = 0, *, base: str = TINY, **row: Any) -> str:
        model_id = f"{self.session_id}:train:{n}"
        fields: dict[str, Any] = {"lora_rank": 4, "lora": {"seed": 0}, "status": "starting"}
        fields.update(row)
        with session_scope(self.ctx.sessions) as db:
            db.add(
                TinkerModel(
                    id=model_id,
                    session_id=self.session_id,
                    project_id=self.project_id,
                    base_model=base,
                    **fields,
                )
            )
        return model_id

    def call(self, model_id: str, kind: str, body: bytes | dict[str, Any]) -> str:
        """Queue a call; its request id."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        seq = self.seq.get(model_id, 0)
        self.seq[model_id] = seq + 1
        request_id = f"tr-{model_id}-{seq}"
        with session_scope(self.ctx.sessions) as db:
            db.add(
                TinkerRequest(
                    request_id=request_id,
                    project_id=self.project_id,
                    model_id=model_id,
                    seq_key=str(seq),
                    kind=kind,
                    body=raw,
                    status="queued",
                )
            )
        return request_id

    def sampler(self, n: int, model_id: str, model_path: str | None = None) -> str:
        sampler_id = f"{self.session_id}:sample:{n}"
        with session_scope(self.ctx.sessions) as db:
            db.add(
                TinkerSampler(
                    id=sampler_id,
                    session_id=self.session_id,
                    project_id=self.project_id,
                    base_model=TINY,
                    model_id=model_id,
                    model_path=model_path,
                )
            )
        return sampler_id

    def request(self, request_id: str) -> TinkerRequest:
        with session_scope(self.ctx.sessions) as db:
            row = db.query(TinkerRequest).filter_by(request_id=request_id).one()
            db.expunge(row)
            return row

    def model_row(self, model_id: str) -> TinkerModel:
        with session_scope(self.ctx.sessions) as db:
            row = db.get(TinkerModel, model_id)
            assert row is not None
            return row

    def settled(self, *request_ids: str, timeout: float = 180) -> list[TinkerRequest]:
        """The requests once none is queued any more."""

        def rows() -> list[TinkerRequest] | None:
            found = [self.request(r) for r in request_ids]
            return found if all(r.status != "queued" for r in found) else None

        result = wait_until(rows, timeout, f"requests {request_ids} to be applied", 0.1)
        assert isinstance(result, list)
        return result

    def age_session(self, seconds: float) -> None:
        with session_scope(self.ctx.sessions) as db:
            row = db.get(TinkerSession, self.session_id)
            assert row is not None
            row.heartbeat_at = utcnow() - timedelta(seconds=seconds)

    def finish_session(self) -> None:
        with session_scope(self.ctx.sessions) as db:
            row = db.get(TinkerSession, self.session_id)
            assert row is not None
            row.finished_at = utcnow()


@pytest.fixture
def client(ctx: WorkerContext) -> Client:
    return new_client(ctx)


def new_client(ctx: WorkerContext) -> Client:
    """A fresh project with one live Tinker session."""
    project_id = new_project_key(ctx.settings)[1]
    session_id = f"ts-{project_id[-8:]}"
    with session_scope(ctx.sessions) as db:
        db.add(TinkerSession(id=session_id, project_id=project_id))
    return Client(ctx, project_id, session_id)


class Holder:
    """hold_tinker_model in a thread (as the Celery task runs it), its outcome at the end."""

    started: ClassVar[list[Holder]] = []

    def __init__(self, ctx: WorkerContext, model_id: str) -> None:
        Holder.started.append(self)
        self.outcome: str | None = None
        self._thread = threading.Thread(target=self._run, args=(ctx, model_id), daemon=True)
        self._thread.start()

    def _run(self, ctx: WorkerContext, model_id: str) -> None:
        self.outcome = hold_tinker_model(ctx, model_id)

    def result(self, timeout: float = 60) -> str | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "hold_tinker_model did not return"
        return self.outcome


def fwdbwd(
    model_id: str,
    data: list[tuple[list[int], dict[str, list[Any]]]],
    loss_fn: str = "cross_entropy",
    *,
    forward_only: bool = False,
    config: dict[str, float | str] | None = None,
) -> bytes:
    """A forward_backward body as the SDK encodes it."""
    request = FwdBwdRequest(
        model_id=model_id,
        seq_id=1,
        loss_fn=loss_fn,
        forward_only=forward_only,
        config=config or {},
        data=[WireDatum(tokens=t, inputs=i) for t, i in data],
    )
    return encode_forward_backward(request)


def floats(raw: bytes) -> list[float]:
    values = array("f")
    values.frombytes(raw)
    return values.tolist()


def fwdbwd_output(raw: bytes) -> tuple[list[list[float]], dict[str, float]]:
    """(per-datum logprobs, metrics) of a ForwardBackwardOutput, read as the SDK reads it."""
    out = ForwardBackwardOutputPb.FromString(raw)
    logprobs: list[list[float]] = []
    for record in out.loss_fn_outputs:
        field_ = record.fields["logprobs"]
        offsets = array("q")
        offsets.frombytes(field_.offsets)
        for a, b in itertools.pairwise(offsets):
            logprobs.append(floats(field_.data[a:b]))
    return logprobs, dict(out.metrics)


def sample_output(raw: bytes) -> tuple[list[tuple[list[int], list[float], int]], list[float]]:
    out = SampleResponsePb.FromString(raw)
    sequences = []
    for seq in out.sequences:
        tokens = array("i")
        tokens.frombytes(seq.tokens)
        sequences.append((tokens.tolist(), floats(seq.logprobs), int(seq.stop_reason)))
    return sequences, floats(out.prompt_logprobs)


def other_worker(ctx: WorkerContext, name: str) -> WorkerContext:
    settings = ctx.settings.model_copy(update={"worker_name": name})
    return WorkerContext(settings, ctx.sessions, ctx.dispatcher)


# ---------------------------------------------------------------------------- no model loaded


def test_the_task_is_registered_like_run_job(ctx: WorkerContext) -> None:
    from app.core.queue import TINKER_MODEL_TASK
    from worker.celery_app import create_celery

    task = create_celery(ctx).tasks[TINKER_MODEL_TASK]
    # A worker lost mid-session redelivers the message; the claim's fence makes that harmless.
    assert (task.acks_late, task.reject_on_worker_lost) == (True, True)


def test_a_model_another_worker_holds_is_not_claimed(ctx: WorkerContext, client: Client) -> None:
    held = client.model(0, lease_owner="worker-a", heartbeat_at=utcnow())
    # Resident elsewhere, even with a stale heartbeat: its weights exist only in that worker.
    stale = utcnow() - timedelta(hours=1)
    resident = client.model(1, status="ready", lease_owner="worker-b", heartbeat_at=stale)
    assert hold_tinker_model(ctx, held) == "not_claimed"
    assert hold_tinker_model(other_worker(ctx, "worker-c"), resident) == "not_claimed"
    assert client.model_row(held).lease_owner == "worker-a"
    assert client.model_row(resident).status == "ready"
    assert hold_tinker_model(ctx, f"{client.session_id}:train:9") == "not_claimed"


def test_an_unknown_base_model_fails_the_model_and_its_calls_as_the_users(
    ctx: WorkerContext, client: Client
) -> None:
    # Claimed from a worker that died while loading it (its heartbeat is long stale).
    stale = utcnow() - timedelta(hours=1)
    model_id = client.model(base="no-such-model", lease_owner="dead-worker", heartbeat_at=stale)
    first = client.call(model_id, "create_model", {"type": "create_model"})
    second = client.call(model_id, "optim_step", {"model_id": model_id, "adam_params": {}})
    assert hold_tinker_model(ctx, model_id) == "failed"
    row = client.model_row(model_id)
    assert (row.status, row.lease_owner) == ("failed", "tinker-under-test")
    assert row.error_message is not None and "could not be loaded" in row.error_message
    for request in client.settled(first, second):
        assert (request.status, request.error_category) == ("failed", "user")
        assert request.error == row.error_message


def test_a_session_that_ended_before_the_claim_closes_its_model_unloaded(
    ctx: WorkerContext, client: Client
) -> None:
    model_id = client.model()
    request = client.call(model_id, "create_model", {"type": "create_model"})
    client.finish_session()
    assert hold_tinker_model(ctx, model_id) == "closed"
    assert client.model_row(model_id).status == "closed"
    (row,) = client.settled(request)
    assert (row.status, row.error_category) == ("failed", "user")
    assert row.error is not None and "session ended" in row.error


# ---------------------------------------------------------------------------- a model loaded


@pytest.mark.model
def test_a_lost_lease_stops_the_loop_and_writes_nothing_more(
    ctx: WorkerContext, client: Client
) -> None:
    model_id = client.model()
    created = client.call(model_id, "create_model", {"type": "create_model"})
    holder = Holder(ctx, model_id)
    (done,) = client.settled(created)
    assert done.status == "done" and json.loads(done.result or b"") == {
        "model_id": model_id,
        "type": "create_model",
    }
    row = client.model_row(model_id)
    assert row.status == "ready" and row.model_folder and Path(row.model_folder).is_dir()
    with session_scope(ctx.sessions) as db:  # the API judged this worker dead
        model = db.get(TinkerModel, model_id)
        assert model is not None
        model.status, model.error_message = "failed", "the worker holding it stopped"
    assert holder.result() == "lease_lost"
    late = client.call(model_id, "optim_step", {"model_id": model_id, "adam_params": {}})
    assert client.request(late).status == "queued"  # the API fails it, not this worker
    assert client.model_row(model_id).error_message == "the worker holding it stopped"


@pytest.mark.model
def test_a_worker_shutdown_fails_the_model_naming_its_last_save(
    ctx: WorkerContext, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply = tinker_requests.HeldModel.apply

    def apply_then_stop(self: tinker_requests.HeldModel, request: Any) -> Any:
        outcome = apply(self, request)
        if request.kind == "save_weights":  # SIGTERM arrives while the save is applied
            ctx.shutdown.set()
        return outcome

    monkeypatch.setattr(tinker_requests.HeldModel, "apply", apply_then_stop)
    model_id = client.model()
    calls = [
        client.call(model_id, "create_model", {"type": "create_model"}),
        client.call(model_id, "save_weights", {"model_id": model_id, "path": "ck1"}),
        client.call(model_id, "optim_step", {"model_id": model_id, "adam_params": {}}),
    ]
    assert Holder(ctx, model_id).result(timeout=180) == "worker_stopped"
    created, saved, dropped = client.settled(*calls)
    assert (created.status, saved.status) == ("done", "done")
    path = f"tinker://{model_id}/weights/ck1"
    row = client.model_row(model_id)
    assert row.status == "failed" and row.last_saved_path == path
    assert row.error_message is not None and f"restore it from {path}" in row.error_message
    assert (dropped.status, dropped.error_category) == ("failed", "server")
    assert dropped.error == row.error_message


@pytest.mark.model
def test_a_silent_session_closes_the_model(ctx: WorkerContext, client: Client) -> None:
    model_id = client.model()
    created = client.call(model_id, "create_model", {"type": "create_model"})
    holder = Holder(ctx, model_id)
    client.settled(created)
    client.age_session(ctx.settings.tinker_session_ttl_s + 5)
    assert holder.result() == "closed"
    row = client.model_row(model_id)
    assert (row.status, row.error_message) == ("closed", None)


def test_a_busy_worker_takes_another_sessions_model_no_idle_worker_took(
    ctx: WorkerContext, client: Client
) -> None:
    held = client.model()
    first = client.call(held, "create_model", {"type": "create_model"})
    holder = Holder(ctx, held)
    client.settled(first)
    # Another project's session, whose model has waited past ADOPT_OTHERS_AFTER_S for a worker
    # (the embedded default has one, busy with the first session for as long as it lives).
    other = new_client(ctx)
    waiting = other.model(created_at=utcnow() - timedelta(seconds=ADOPT_OTHERS_AFTER_S + 5))
    created = other.call(waiting, "create_model", {"type": "create_model"})
    (done,) = other.settled(created)
    assert (
        done.status == "done" and other.model_row(waiting).lease_owner == ctx.settings.worker_name
    )
    other.finish_session()
    client.finish_session()
    assert holder.result() == "closed"  # the task ends once every model it took has ended
    assert other.model_row(waiting).status == "closed"


@pytest.mark.model  # the adopted model loads in its thread
def test_a_worker_takes_no_model_beyond_its_bound(ctx: WorkerContext, client: Client) -> None:
    owner = ctx.settings.worker_name
    held = client.model(status="ready", lease_owner=owner, heartbeat_at=utcnow())
    ref = ModelRef(held, client.session_id, client.project_id, TINY, owner)
    # The same session's: taken at once and before any other session's waiting model (the
    # database may hold such models of other tests, never claimed).
    waiting = client.model(1)
    adopted: list[threading.Thread] = []
    ctx.settings.tinker_models_per_worker = 1  # the held model fills it
    _adopt_waiting(ctx, ref, adopted)
    assert adopted == [] and client.model_row(waiting).lease_owner is None
    ctx.settings.tinker_models_per_worker = 2
    _adopt_waiting(ctx, ref, adopted)
    assert len(adopted) == 1 and client.model_row(waiting).lease_owner == ref.owner
    client.finish_session()  # the adopted model's thread ends with its session
    adopted[0].join(60)
    assert not adopted[0].is_alive() and client.model_row(waiting).status == "closed"
