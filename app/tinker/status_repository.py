"""The one writer of the Tinker API's status columns (``tinker_models.status``,
``tinker_requests.status``): every change is a move of ``app.tinker.states``' tables, written
as a conditional update that matches only rows in a state the move may come from, so a row
never takes a move its table does not allow, whoever asks. The callers (the worker's lease,
the upkeep, the API's call intake) name the move and what else it writes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from app.core.tinker_tables import TinkerModel, TinkerRequest
from app.tinker.states import (
    MODEL_MOVES,
    REQUEST_MOVES,
    ModelStatus,
    RequestStatus,
    may_come_from,
)

__all__ = ["finish_requests", "move_model", "requeue_model"]

Synchronize = Literal["auto", False]


def _sources(target: ModelStatus, given: Iterable[ModelStatus] | None) -> tuple[ModelStatus, ...]:
    allowed = may_come_from(target, MODEL_MOVES)
    if given is None:
        return allowed
    sources = tuple(given)
    illegal = [s for s in sources if s not in allowed]
    if illegal:
        raise ValueError(f"a model cannot move from {illegal} to {target}")
    return sources


def move_model(
    db: Session,
    *,
    model_id: str,
    to: ModelStatus,
    from_: Iterable[ModelStatus] | None = None,
    where: Sequence[ColumnElement[bool]] = (),
    values: Mapping[str, Any] | None = None,
    synchronize: Synchronize = "auto",
) -> bool:
    """Move the model to ``to`` from one of ``from_`` (each a move the table allows; None:
    every state that may move there), under the ``where`` conditions too, writing ``values``
    with it; False when the row was in none of them (or the conditions failed). Pass
    ``synchronize=False`` when ``where`` compares datetimes (SQLite hands back naive ones, so
    the session cannot evaluate the criteria in Python)."""
    sources = _sources(to, from_)  # a move the table rules out never reaches the database
    result = db.execute(
        update(TinkerModel)
        .where(TinkerModel.id == model_id, TinkerModel.status.in_(sources), *where)
        .values(status=to.value, **(values or {}))
        .execution_options(synchronize_session=synchronize)
    )
    return int(getattr(result, "rowcount", 0) or 0) == 1


def requeue_model(model: TinkerModel, *, now: datetime) -> None:
    """A released model, loaded in this unit of work (under its row's lock), back to the queue
    (``starting``: a call arrived): no lease, queued and sent ``now``."""
    if ModelStatus(model.status) not in _sources(ModelStatus.STARTING, None):
        raise ValueError(f"model {model.id} is {model.status}: it cannot go back to the queue")
    model.status = ModelStatus.STARTING.value
    model.lease_owner = None
    model.heartbeat_at = None
    model.queued_at = now
    model.dispatched_at = now


def finish_requests(
    db: Session,
    *,
    to: RequestStatus,
    where: Sequence[ColumnElement[bool]],
    values: Mapping[str, Any],
    synchronize: Synchronize = "auto",
) -> int:
    """End the queued calls matching ``where`` as ``to`` (done or failed), writing ``values``
    with it; how many."""
    sources = may_come_from(to, REQUEST_MOVES)
    result = db.execute(
        update(TinkerRequest)
        .where(TinkerRequest.status.in_(sources), *where)
        .values(status=to.value, **values)
        .execution_options(synchronize_session=synchronize)
    )
    return int(getattr(result, "rowcount", 0) or 0)
