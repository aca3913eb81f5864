"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.core.deps import StateDep
from app.health.probes import readiness
from app.health.schemas import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Database and broker reachable",
    responses={503: {"model": Readiness, "description": "A dependency is down."}},
)
def readyz(state: StateDep) -> JSONResponse:
    checks = readiness(state.engine, state.settings)
    ok = all(value == "ok" for value in checks.values())
    body = Readiness(status="ok" if ok else "unavailable", **checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
