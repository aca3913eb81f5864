"""The kinds of Tinker call are declared once (app.tinker.states.RequestKind): the worker
applies every kind the routes store, each with a method of its own, and nothing else."""

from __future__ import annotations

from app.tinker.states import REQUEST_KINDS
from worker import tinker_requests


def test_the_worker_applies_every_kind_the_routes_store() -> None:
    assert set(tinker_requests.HANDLERS) == set(REQUEST_KINDS)
    applier = tinker_requests.HeldModel
    for kind, method in tinker_requests.HANDLERS.items():
        assert callable(getattr(applier, method, None)), kind
    assert len(set(tinker_requests.HANDLERS.values())) == len(REQUEST_KINDS)
