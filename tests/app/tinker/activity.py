"""Tinker activity for the tests of GET /v1/usage and GET /v1/tinker/sessions: calls of each
kind made through the Tinker API's own paths, as the SDK sends them (forward_backward and
forward as protobuf), and their outcomes written into the request rows as a worker writes them
(no worker runs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest, TinkerSession
from app.tinker import wire
from app.tinker.wire import FwdBwdRequest, WireDatum
from tests.app.tinker.test_tinker_api import Tinker
from tests.conftest import Api


def tinker_of(api: Api) -> Tinker:
    """The Tinker SDK's client of `api`'s project (its key with the `tml-` prefix)."""
    return Tinker(api.client, api.settings, "tml-" + api.key)


def named_session(tinker: Tinker, display_name: str) -> str:
    answer = tinker.post(
        "create_session",
        {"tags": ["t1"], "sdk_version": "0.38.0", "display_name": display_name},
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["session_id"])


def forward_backward(tinker: Tinker, model_id: str, seq_id: int, *, forward_only: bool) -> str:
    """A one-datum cross_entropy forward_backward (or forward) call; its request id."""
    datum = WireDatum(tokens=[1, 2, 3], inputs={"target_tokens": [2, 3, 4]})
    body = wire.encode_forward_backward(
        FwdBwdRequest(model_id, seq_id, "cross_entropy", forward_only, {}, [datum])
    )
    answer = tinker.client.post(
        "/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": tinker.key, "Content-Type": "application/x-protobuf"},
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["request_id"])


def accepted(answer: Any) -> str:
    assert answer.status_code == 200, answer.text
    return str(answer.json()["request_id"])


def save_state(tinker: Tinker, model_id: str, seq_id: int, name: str) -> str:
    return accepted(
        tinker.post("save_weights", {"model_id": model_id, "seq_id": seq_id, "path": name})
    )


def sampler_and_sample(tinker: Tinker, model_id: str, seq_id: int) -> tuple[str, str]:
    """save_weights_and_get_sampling_client, then one sample call: both request ids."""
    saved = accepted(
        tinker.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "seq_id": seq_id, "sampling_session_seq_id": 0},
        )
    )
    session_id = model_id.split(":train:")[0]
    sample = accepted(
        tinker.post(
            "asample",
            {
                "sampling_session_id": f"{session_id}:sample:0",
                "seq_id": 0,
                "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 4},
            },
        )
    )
    return saved, sample


def first_request(settings: Settings, model_id: str) -> str:
    """The request id of the model's creation (seq 0)."""
    with _db(settings) as db:
        row = db.query(TinkerRequest).filter_by(model_id=model_id, seq_key="0").one()
        return str(row.request_id)


def settle(settings: Settings, request_id: str, status: str) -> None:
    """Write a request's outcome (done or failed) as the model's worker does."""
    values: dict[str, Any] = {"status": status, "finished_at": utcnow()}
    if status == "failed":
        values.update(error="boom", error_category="user")
    else:
        values.update(result=b"{}", result_format="json")
    with _db(settings) as db:
        db.execute(
            update(TinkerRequest).where(TinkerRequest.request_id == request_id).values(values)
        )


def backdate(settings: Settings, when: datetime, *, session_id: str) -> None:
    """Move a session, its models and their requests to `when` (made days ago)."""
    with _db(settings) as db:
        moved = {"created_at": when, "heartbeat_at": when}
        db.execute(update(TinkerSession).where(TinkerSession.id == session_id).values(moved))
        models = [m.id for m in db.query(TinkerModel).filter_by(session_id=session_id)]
        db.execute(update(TinkerModel).where(TinkerModel.id.in_(models)).values(created_at=when))
        db.execute(
            update(TinkerRequest).where(TinkerRequest.model_id.in_(models)).values(created_at=when)
        )


@contextmanager
def _db(settings: Settings) -> Iterator[Session]:
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            yield db
    finally:
        engine.dispose()
