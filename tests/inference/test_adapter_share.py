"""Adapter slots shared fairly by the real pool (inference.pool, inference.records) over the
stand-in engines of test_pool (no vLLM process: the real-engine version of the finding is
test_adapter_share_engine.py, marked `process` and `model`).

Issue 44: one project chatting with its 8 sampler saves every ~5 s held every adapter slot of
the shared engine (an adapter used in the last 30 s was never evicted), and another project's
own fine-tuned model answered 503 ``adapter_loading`` to every request. Now a project holds at
most its share (429 ``adapter_share`` past it while its requests use every one), an adapter is
pinned by the holds of the requests using it (released when each ends), and room is made from
the project holding the most."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from app.gateway.engine_identity import EngineEnsureRequest
from app.gateway.protocol import (
    ENSURE_PATH,
    RELEASE_PATH,
    Busy,
    EnsureResponse,
    SamplerWeightsRef,
    WeightsRef,
)
from inference.control import create_control_app
from inference.pool import EnginePool, adapter_owner
from tests.conftest import wait_until
from tests.inference.test_pool import (  # noqa: F401 (make_pool: a fixture)
    StandInEngine,
    make_pool,
    run,
    until_ready,
)

CHECKPOINT = "checkpoint-000001"


def _adapters(tmp_path: Path, *jobs: str) -> None:
    """LoRA checkpoints of ``jobs`` in the pool's store (beside test_pool's job_a..job_c)."""
    for job in jobs:
        folder = tmp_path / "data" / "checkpoints" / job / CHECKPOINT
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")


def _ask(project: str, job: str) -> EngineEnsureRequest:
    return EngineEnsureRequest(
        base_model="tiny", adapter={"job_id": job, "folder": CHECKPOINT}, project_id=project
    )


def _served(job: str) -> str:
    return f"{job}/{CHECKPOINT}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_project_using_every_slot_continuously_leaves_another_projects_model_served(
    make_pool: Callable[..., EnginePool],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The finding, on the pool: project A chats with 8 adapters in turn (two requests in
    flight at a time, a new round every 5 s of its clock) on an engine of 8 slots, with the
    default 30 s keep; B asks for its own adapter after every one of A's requests, and every
    one of B's answers is its model, never a Busy. A keeps at most its share, 4 slots."""
    a_jobs = [f"job_a{i}" for i in range(8)]
    _adapters(tmp_path, *a_jobs, "job_b0")
    clock = Clock()

    async def scenario() -> None:
        pool = make_pool(clock=clock, max_adapters=8, keep_after_ensure_s=30)
        await until_ready(pool, EngineEnsureRequest(base_model="tiny"))
        [engine] = StandInEngine.instances
        a_answers: list[EnsureResponse | Busy] = []
        b_answers: list[EnsureResponse | Busy] = []
        in_flight: list[str] = []  # A's holds, two at most
        for _ in range(6):  # rounds
            clock.now += 5.0
            for job in a_jobs:
                answer = await pool.ensure(_ask("proj_a", job))
                a_answers.append(answer)
                if isinstance(answer, EnsureResponse):
                    assert answer.hold is not None
                    in_flight.append(answer.hold)
                if len(in_flight) == 2:  # the older of A's requests ends
                    assert pool.release(in_flight.pop(0))
                b_answer = await pool.ensure(_ask("proj_b", "job_b0"))
                b_answers.append(b_answer)
                if isinstance(b_answer, EnsureResponse) and b_answer.hold is not None:
                    assert pool.release(b_answer.hold)
                held_by_a = [n for n in engine.adapters if n.startswith("job_a")]
                assert len(held_by_a) <= 4, engine.adapters  # A's share of 8
        assert all(isinstance(b, EnsureResponse) for b in b_answers), [
            b for b in b_answers if isinstance(b, Busy)
        ]
        assert {b.served_model for b in b_answers if isinstance(b, EnsureResponse)} == {
            _served("job_b0")
        }
        # A itself is served too: each of its requests finds one of its own adapters free.
        assert all(isinstance(a, EnsureResponse) for a in a_answers)

    run(scenario)


def test_a_project_past_its_share_waits_and_the_others_are_served(
    make_pool: Callable[..., EnginePool],  # noqa: F811
    tmp_path: Path,
) -> None:
    _adapters(tmp_path, "job_a0", "job_a1", "job_b0", "job_c0")

    async def scenario() -> None:
        pool = make_pool(max_adapters=2, keep_after_ensure_s=600)  # share: 1 of 2
        first = await until_ready(pool, _ask("proj_a", "job_a0"))  # its request is running
        refused = await pool.ensure(_ask("proj_a", "job_a1"))
        assert isinstance(refused, Busy) and refused.reason == "adapter_share", refused
        assert refused.retry_after_s >= 1
        assert refused.detail == (
            "this project holds 1 of the 2 adapter slots of the engine of tiny, its share "
            "(GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT=1), and its requests in flight use "
            "every one; retry when one of them ends"
        )
        b = await pool.ensure(_ask("proj_b", "job_b0"))
        assert isinstance(b, EnsureResponse) and b.served_model == _served("job_b0")
        # Every slot is used by a request in flight: a third project waits for one to end.
        full = await pool.ensure(_ask("proj_c", "job_c0"))
        assert isinstance(full, Busy) and full.reason == "adapter_capacity", full
        assert "GRPO_INFERENCE_MAX_ADAPTERS" in full.detail and "2 adapter slots" in full.detail
        # A's request ends: A's next adapter replaces its own; B's ends: C gets B's slot.
        assert first.hold is not None and pool.release(first.hold)
        again = await pool.ensure(_ask("proj_a", "job_a1"))
        assert isinstance(again, EnsureResponse) and not again.warm
        [engine] = StandInEngine.instances
        assert engine.adapters == [_served("job_b0"), _served("job_a1")]
        assert b.hold is not None and pool.release(b.hold)
        c = await pool.ensure(_ask("proj_c", "job_c0"))
        assert isinstance(c, EnsureResponse)
        assert engine.adapters == [_served("job_a1"), _served("job_c0")]
        assert not pool.release(b.hold)  # released already (and its adapter unloaded)

    run(scenario)


def test_a_hold_never_released_lapses_after_the_keep_and_a_running_request_still_pins(
    make_pool: Callable[..., EnginePool],  # noqa: F811
    tmp_path: Path,
) -> None:
    _adapters(tmp_path, "job_a0", "job_b0")
    clock = Clock()

    async def scenario() -> None:
        pool = make_pool(clock=clock, max_adapters=1, keep_after_ensure_s=30)
        await until_ready(pool, _ask("proj_a", "job_a0"))  # its gateway never releases
        blocked = await pool.ensure(_ask("proj_b", "job_b0"))
        assert isinstance(blocked, Busy) and blocked.reason == "adapter_capacity"
        clock.now += 30
        StandInEngine.adapters_in_use = frozenset({_served("job_a0")})  # still running
        still = await pool.ensure(_ask("proj_b", "job_b0"))
        assert isinstance(still, Busy) and still.reason == "adapter_capacity"
        StandInEngine.adapters_in_use = frozenset()
        served = await pool.ensure(_ask("proj_b", "job_b0"))
        assert isinstance(served, EnsureResponse) and served.served_model == _served("job_b0")

    run(scenario)


def test_the_state_tells_the_share(make_pool: Callable[..., EnginePool]) -> None:  # noqa: F811
    state = run(make_pool(max_adapters=6).state)
    assert (state.max_adapters_per_engine, state.max_adapters_per_project) == (6, 3)


def test_an_adapter_counts_against_its_project() -> None:
    job = WeightsRef(job_id="job_x", folder=CHECKPOINT)
    save = SamplerWeightsRef(project_id="proj_s", model_id="m:train:0", name="s", version=1)
    asked = EngineEnsureRequest(base_model="tiny", project_id="proj_q")
    assert adapter_owner(asked, job) == "proj_q"
    assert adapter_owner(asked, save) == "proj_s"  # a Tinker save names its project
    assert adapter_owner(EngineEnsureRequest(base_model="tiny"), job) == "job job_x"


def test_the_control_api_answers_a_projects_share_with_429_and_releases_holds(
    make_pool: Callable[..., EnginePool],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The one path of a Busy to HTTP: adapter_share is a 429, adapter_capacity a 503, both
    with Retry-After and the Busy body; a release is idempotent."""
    _adapters(tmp_path, "job_a0", "job_a1")
    pool = make_pool(max_adapters=2, keep_after_ensure_s=600)

    def body(job: str) -> dict[str, object]:
        return _ask("proj_a", job).model_dump(mode="json")

    with TestClient(create_control_app(pool)) as client:

        def ensured() -> EnsureResponse | None:  # the engine starts in the client's loop
            response = client.post(ENSURE_PATH, json=body("job_a0"))
            if response.status_code == 200:
                return EnsureResponse(**response.json())
            assert response.json()["reason"] == "engine_starting", response.text
            return None

        held = wait_until(ensured, 30, "the adapter to be ready", interval=0.01)
        assert isinstance(held, EnsureResponse)
        refused = client.post(ENSURE_PATH, json=body("job_a1"))
        assert refused.status_code == 429, refused.text
        assert Busy(**refused.json()).reason == "adapter_share"
        assert refused.headers["Retry-After"] == str(refused.json()["retry_after_s"])
        assert client.post(RELEASE_PATH, json={"hold": held.hold}).json() == {"released": True}
        assert client.post(RELEASE_PATH, json={"hold": held.hold}).json() == {"released": False}
        assert client.post(ENSURE_PATH, json=body("job_a1")).status_code == 200
