"""The gateway and the inference tier name the served weights alike (app.gateway.served_kinds):
what a pool made ready, its state shows under the names the gateway looks for, for every kind,
in the dtype its operator set."""

from __future__ import annotations

from collections.abc import Callable

from app.gateway import routing
from app.gateway.engine_identity import EngineEnsureRequest
from inference.pool import EnginePool
from tests.inference.test_pool import (  # noqa: F401  (make_pool: a fixture)
    ENGINE,
    adapter,
    full,
    make_pool,
    run,
    until_ready,
)


def test_the_gateway_finds_what_the_pool_made_ready(
    make_pool: Callable[..., EnginePool],  # noqa: F811
) -> None:
    checkpoint = {"job_id": "job_f2", "folder": "checkpoint-000001"}
    requests = {
        "base at a revision": EngineEnsureRequest(base_model="tiny", revision="v2"),
        "full": full("job_f1"),
        "lora": adapter("job_a"),
        "lora over a full checkpoint": EngineEnsureRequest(
            base_model="tiny", base_weights=checkpoint, adapter=adapter("job_b").adapter
        ),
    }

    async def scenario() -> None:
        pool = make_pool(dtype="bfloat16", memory_budget_bytes=4 * ENGINE)
        for what, request in requests.items():
            answer = await until_ready(pool, request)
            state = await pool.state()
            assert state.dtype == "bfloat16"
            warmth = routing.warmth(state, request, request.options())
            assert warmth == routing.WEIGHTS_WARM, what
            served = {e.key for e in state.engines} | {a for e in state.engines for a in e.adapters}
            assert answer.served_model in served, what

    run(scenario)
