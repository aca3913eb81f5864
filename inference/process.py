"""`grpo inference`: the control API under uvicorn, the engine pool, and the registration
heartbeat, in one process.

Start: refuse to start without the token shared with the API (GRPO_INFERENCE_TOKEN), refuse
devices shared with the training workers (inference.devices), register, start the
engines of the ``preload`` bases (in the background). Nothing else is resolved or started
before the first ensure asks for it. Every ``HEARTBEAT_S``: rewrite the
row with the state. SIGTERM or SIGINT (uvicorn's handlers): stop serving, stop every engine,
remove the row; uvicorn then re-raises the signal, so a clean stop exits with -SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from app.core.gateway_settings import MIN_TOKEN_CHARS
from app.core.settings import Settings
from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import HEARTBEAT_S, Busy
from inference.control import create_control_app
from inference.devices import sharing_refusal
from inference.pool import EnginePool
from inference.records import EnsureError
from inference.registry import Registration
from inference.settings import InferenceSettings

log = logging.getLogger(__name__)


async def _heartbeat(pool: EnginePool, registration: Registration) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        await asyncio.to_thread(registration.write, await pool.state())


async def preload_base(pool: EnginePool, base: str, poll_s: float = 1.0) -> None:
    """Ensure ``base`` every ``poll_s`` until its engine is up (the first ensures may only
    resolve the model; one that finds the budget held waits like a request would)."""
    request = EngineEnsureRequest(base_model=base)
    try:
        while isinstance(answer := await pool.ensure(request), Busy):
            await asyncio.sleep(poll_s)
    except EnsureError as exc:
        log.error("inference: preloading %s failed: %s", base, exc.detail)
        return
    log.info("inference: preloaded %s at %s", base, answer.base_url)


def build_app(settings: InferenceSettings, app_settings: Settings) -> FastAPI:
    """The control app whose lifespan owns the pool and the registration."""
    pool = EnginePool(settings, app_settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        registration = Registration(settings, app_settings)
        await asyncio.to_thread(registration.write, await pool.state())
        beating = asyncio.create_task(_heartbeat(pool, registration))
        preloading = [asyncio.create_task(preload_base(pool, b)) for b in settings.preload_list]
        log.info("inference: %s serving %s", settings.control_url, ", ".join(settings.base_list))
        try:
            yield
        finally:
            for task in (beating, *preloading):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await pool.close()
            await asyncio.to_thread(registration.remove)
            log.info("inference: engines stopped, unregistered")

    return create_control_app(pool, lifespan=lifespan)


def token_refusal(settings: InferenceSettings) -> str | None:
    """Why the process must not start without its token: whoever reaches an unguarded control
    API can make any project's checkpoint servable and call the engines."""
    token = settings.token.get_secret_value() if settings.token is not None else ""
    if len(token) >= MIN_TOKEN_CHARS:
        return None
    said = "is not set" if not token else f"has {len(token)} characters"
    return (
        f"GRPO_INFERENCE_TOKEN {said}: set it, {MIN_TOKEN_CHARS} characters or more (e.g. "
        "`openssl rand -hex 32`), to the same value as the API's GRPO_INFERENCE_TOKEN; the "
        "control API and the engines answer only calls that carry it (`grpo serve` makes one "
        "for its embedded process)"
    )


def run_inference(settings: InferenceSettings, app_settings: Settings) -> int:
    refusal = token_refusal(settings) or sharing_refusal(
        settings.engine_devices, settings.training_devices, share=settings.share_devices
    )
    if refusal is not None:
        print(f"grpo inference: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app = build_app(settings, app_settings)
    print(f"Inference control API on {settings.control_url} (id {settings.server_id})", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    return 0
