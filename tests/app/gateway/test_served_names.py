"""The gateway finds warm weights in an inference process's state by their whole served name
(app.gateway.served_kinds), never by a part of it: a job id or a checkpoint folder that
holds another's is another checkpoint."""

from __future__ import annotations

from typing import Any

from app.gateway import routing
from app.gateway.protocol import EnsureRequest, ServerState, WeightsRef

STEP_100000 = WeightsRef(job_id="job_a", folder="checkpoint-100000")
# Names that hold both the job id and the folder of STEP_100000, of other checkpoints.
NEIGHBOURS = ["job_ab/checkpoint-100000", "job_a/checkpoint-1000000", "xjob_a/checkpoint-100000"]


def _state(*engines: tuple[str, list[str]], **extra: Any) -> ServerState:
    return ServerState(
        engines=[
            {
                "key": key,
                "base_url": "http://e",
                "status": "ready",
                "adapters": adapters,
                "memory_bytes": 1,
                "running_requests": 0,
            }
            for key, adapters in engines
        ],
        memory_budget_bytes=1,
        memory_used_bytes=0,
        max_adapters_per_engine=4,
        **extra,
    )


def test_an_adapter_is_warm_by_its_whole_name() -> None:
    lora = EnsureRequest(base_model="b", adapter=STEP_100000)
    assert routing.warmth(_state(("b", NEIGHBOURS)), lora) == routing.ENGINE_WARM
    loaded = _state(("b", [*NEIGHBOURS, "job_a/checkpoint-100000"]))
    assert routing.warmth(loaded, lora) == routing.WEIGHTS_WARM


def test_a_checkpoints_engine_is_warm_by_its_whole_name() -> None:
    full = EnsureRequest(base_model="b", full=STEP_100000)
    for key in NEIGHBOURS:
        assert routing.warmth(_state((key, [])), full) == routing.COLD
    assert routing.warmth(_state(("job_a/checkpoint-100000", [])), full) == routing.WEIGHTS_WARM
    over_it = EnsureRequest(
        base_model="b",
        base_weights=STEP_100000,
        adapter=WeightsRef(job_id="job_l", folder=STEP_100000.folder),
    )
    assert routing.warmth(_state((NEIGHBOURS[0], [])), over_it) == routing.COLD
    assert routing.warmth(_state(("job_a/checkpoint-100000", [])), over_it) == routing.ENGINE_WARM


def test_engines_are_named_in_the_dtype_their_process_runs_them_in() -> None:
    """A process whose operator set GRPO_INFERENCE_DTYPE keys its engines in that dtype and says
    so in its state: its engine is the one a float32 job's weights run in there."""
    full = EnsureRequest(base_model="b", full=STEP_100000)
    engine = ("job_a/checkpoint-100000#bfloat16", [])
    assert routing.warmth(_state(engine), full) == routing.COLD
    assert routing.warmth(_state(engine, dtype="bfloat16"), full) == routing.WEIGHTS_WARM
    base = EnsureRequest(base_model="b")
    assert (
        routing.warmth(_state(("b#bfloat16", []), dtype="bfloat16"), base) == routing.WEIGHTS_WARM
    )
