"""The control API of a `grpo inference` process, called by the gateway (app.gateway):

- ``POST /engines/ensure`` (app.gateway.protocol.ENSURE_PATH): an EnsureRequest (with the
  revision, dtype and project of app.gateway.engine_identity.EngineEnsureRequest); 200 with
  an EnsureResponse, or a Busy body with ``Retry-After``: 503, or 429 when the project already
  holds its share of the engine's adapter slots and its requests use every one
  (app.gateway.protocol.busy_status); 403 for a checkpoint name that
  leads outside the checkpoint store, 404 for weights that are not here (or a base model not
  served here), 422 for weights that can never be served here (a base model that does not
  resolve, an engine larger than the budget, adapters of a rank past ``max_lora_rank`` or that
  vLLM refuses), 502 when the engine failed to start (said once; the next ensure starts it
  again) or to load an adapter. Error bodies: ``{"detail"}``, naming no server path.
- ``POST /engines/release`` (RELEASE_PATH): a HoldRelease, the request that got the hold in
  an ensure answer ended; 200 ``{"released": bool}`` (False: unknown, lapsed or released
  already; releasing twice is harmless).
- ``GET /engines``: the ServerState (what the registry row holds, fresh).
- ``GET /health``: 200 while the process runs.

Guard: it listens on loopback by default (inference.settings), and every call but /health must
carry ``GRPO_INFERENCE_TOKEN`` in ``X-Inference-Token`` (app.gateway.protocol); `grpo
inference` refuses to start without a token (inference.process). An app built without one (the
tests' pools in-process) checks nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse

from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import (
    ENSURE_PATH,
    RELEASE_PATH,
    TOKEN_HEADER,
    Busy,
    EnsureResponse,
    HoldRelease,
    ServerState,
    busy_status,
)
from inference.pool import EnginePool
from inference.records import EnsureError

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def _token_check(expected: str | None) -> Callable[[str | None], None]:
    def check(token: str | None = Header(default=None, alias=TOKEN_HEADER)) -> None:
        if expected is None:
            return
        if token is None or not secrets.compare_digest(token.encode(), expected.encode()):
            raise HTTPException(status_code=401, detail=f"missing or wrong {TOKEN_HEADER}")

    return check


def create_control_app(pool: EnginePool, *, lifespan: Lifespan | None = None) -> FastAPI:
    token = pool.settings.token.get_secret_value() if pool.settings.token else None
    guarded = [Depends(_token_check(token))]
    app = FastAPI(title="grpo inference control", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.post(ENSURE_PATH, response_model=EnsureResponse, dependencies=guarded)
    async def ensure(request: EngineEnsureRequest) -> EnsureResponse | JSONResponse:
        try:
            result = await pool.ensure(request)
        except EnsureError as exc:
            return JSONResponse({"detail": exc.detail}, status_code=exc.status)
        if isinstance(result, Busy):
            return JSONResponse(
                result.model_dump(),
                status_code=busy_status(result),
                headers={"Retry-After": str(result.retry_after_s)},
            )
        return result

    @app.post(RELEASE_PATH, dependencies=guarded)
    async def release(body: HoldRelease) -> dict[str, bool]:
        return {"released": pool.release(body.hold)}

    @app.get("/engines", response_model=ServerState, dependencies=guarded)
    async def engines() -> ServerState:
        return await pool.state()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app
