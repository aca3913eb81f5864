"""The states of the Tinker API's rows, declared once: a training client's model and a call
(request), each an enum with the moves it may make. ``app.tinker.status_repository`` is the
one module that writes either status, and only along these moves (an AST test in
tests/test_architecture.py keeps it so); everything else reads them through these names.

A model (``tinker_models.status``)::

    starting --claimed and loaded--> ready --idle--> released --called again--> starting
        \\                            |  \\                       \\
         `--failed (unclaimed,       |   `--closed (session      `--closed (its session ended)
            lost, load error)        |      over) | failed
                                     `--failed (worker lost, error)

A call (``tinker_requests.status``): queued, then done (its result stored) or failed (its
error stored); neither ends.

A call's kind (``tinker_requests.kind``) is one of :data:`RequestKind`: what the routes store
and what the worker applies, by that name.

A session has no status column: it is live while its heartbeats arrive, finished once the
client says so, expired once silent (``app.tinker.listing_schemas.SessionState``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeVar, get_args

__all__ = [
    "CLIENT_STATUSES",
    "ENDED_MODEL_STATUSES",
    "LIVE_MODEL_STATUSES",
    "MODEL_MOVES",
    "REQUEST_KINDS",
    "REQUEST_MOVES",
    "ModelStatus",
    "RequestKind",
    "RequestStatus",
    "may_come_from",
]


class ModelStatus(StrEnum):
    STARTING = "starting"  # queued for a worker (created, or called again once released)
    READY = "ready"  # resident on its worker, which holds its lease
    RELEASED = "released"  # idle: written to disk whole, no worker
    CLOSED = "closed"  # its session ended
    FAILED = "failed"  # unclaimed, lost with its worker, or an error on the worker


class RequestStatus(StrEnum):
    QUEUED = "queued"
    DONE = "done"
    FAILED = "failed"


RequestKind = Literal[
    "create_model",
    "load_weights",
    "forward_backward",
    "forward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "sample",
]
REQUEST_KINDS: tuple[RequestKind, ...] = get_args(RequestKind)

MODEL_MOVES: dict[ModelStatus, frozenset[ModelStatus]] = {
    ModelStatus.STARTING: frozenset({ModelStatus.READY, ModelStatus.CLOSED, ModelStatus.FAILED}),
    ModelStatus.READY: frozenset({ModelStatus.RELEASED, ModelStatus.CLOSED, ModelStatus.FAILED}),
    ModelStatus.RELEASED: frozenset({ModelStatus.STARTING, ModelStatus.CLOSED}),
    ModelStatus.CLOSED: frozenset(),
    ModelStatus.FAILED: frozenset(),
}
REQUEST_MOVES: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.QUEUED: frozenset({RequestStatus.DONE, RequestStatus.FAILED}),
    RequestStatus.DONE: frozenset(),
    RequestStatus.FAILED: frozenset(),
}

# Models that hold (or are about to hold) a worker, with its lease.
LIVE_MODEL_STATUSES = (ModelStatus.STARTING, ModelStatus.READY)
# A released model is still the client's: with the live ones, what the project's quota of
# training clients counts.
CLIENT_STATUSES = (*LIVE_MODEL_STATUSES, ModelStatus.RELEASED)
ENDED_MODEL_STATUSES = (ModelStatus.CLOSED, ModelStatus.FAILED)


S = TypeVar("S", ModelStatus, RequestStatus)


def may_come_from(target: S, moves: dict[S, frozenset[S]]) -> tuple[S, ...]:
    """The states that may move to ``target`` under ``moves``."""
    return tuple(source for source, targets in moves.items() if target in targets)
