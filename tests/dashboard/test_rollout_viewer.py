"""The rollout viewer in headless Chromium against the real API: an agent job's completions open
to their episode's turns (the model's tool call with its arguments, the tool's result, a failed
call, the environment's messages, each kind drawn differently, and the end reason), and a
single-turn job's rollouts look as they always did.

The samples are what the worker stores (``dataclasses.asdict`` of the trainer's samples, the
transcripts built by ``trainer.agents.sample_transcript``), written through the worker's
repository: no model runs."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.job_status import JobStatus
from tests.conftest import tiny_spec
from tests.dashboard.conftest import JobWriter, Served
from trainer.agents.episode import Episode
from trainer.agents.samples import sample_transcript
from trainer.run.callbacks import CompletionSample, RolloutSample

pytestmark = pytest.mark.browser

SHOTS = Path(os.environ.get("GRPO_SCREENSHOT_DIR") or tempfile.mkdtemp(prefix="grpo-shots-"))
PROMPT = "What is 12 times 34?"


def episode(log: list[dict[str, Any]], end: Any, detail: str | None = None) -> dict[str, Any]:
    ep = Episode.start(0, {}, [{"role": "user", "content": PROMPT}], [1, 2])
    ep.log.extend(log)
    ep.end(end, detail)
    return sample_transcript(ep)


def model(content: str, *calls: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "source": "model",
        "role": "assistant",
        "content": content,
        "tool_calls": [{"name": n, "arguments": a} for n, a in calls],
        "malformed": [],
    }


def result(name: str, content: str, error: str | None = None) -> dict[str, Any]:
    return {"source": "tool", "role": "tool", "name": name, "content": content, "error": error}


def environment(content: str) -> dict[str, Any]:
    return {"source": "environment", "role": "user", "content": content}


# Episode 1: the environment's opening, a call, its result, the answer. Episode 2: a call that
# fails, the answer, the environment's question, the answer again, then the environment fails.
SOLVED = episode(
    [
        environment("Use the calculator."),
        model("Let me compute.", ("multiply", {"a": 12, "b": 34})),
        result("multiply", "408"),
        model("The answer is 408."),
    ],
    "done",
)
FAILED = episode(
    [
        model("", ("divide", {"a": 1, "b": 0})),
        result("divide", "error: ZeroDivisionError", error="ZeroDivisionError: division by zero"),
        model("I cannot tell."),
        environment("Are you sure?"),
        model("Yes."),
    ],
    "error",
    "the environment's step failed: HTTP 500",
)


def stored(completions: list[CompletionSample]) -> list[dict[str, Any]]:
    """One group as the worker stores it (worker.progress.DatabaseCallbacks.on_samples)."""
    return [dataclasses.asdict(RolloutSample(PROMPT, "408", completions))]


@pytest.fixture
def jobs(served: Served) -> Iterator[dict[str, JobWriter]]:
    """An agent job and a single-turn job, each running with step 1 and its samples."""
    writers = {}
    for name in ("agent", "single"):
        spec = {**tiny_spec(steps=5), "name": name}
        response = httpx.post(
            f"{served.url}/v1/jobs", json=spec, headers=served.headers, timeout=30
        )
        assert response.status_code == 201, response.text
        writers[name] = JobWriter(served, response.json()["id"])
        writers[name].status(JobStatus.RUNNING)
    writers["agent"].samples(
        1,
        stored(
            [
                CompletionSample("The answer is 408.", 1.0, {"m": 1.0}, 0.7, 40, "stop", SOLVED),
                CompletionSample("Yes.", 0.0, {"m": 0.0}, -0.7, 35, "stop", FAILED),
            ]
        ),
    )
    writers["single"].samples(1, stored([CompletionSample("408", 1.0, {"m": 1.0}, 0.0, 3, "stop")]))
    for writer in writers.values():
        writer.step(1)
    yield writers
    for writer in writers.values():
        writer.engine.dispose()


def _open_job(page: Any, served: Served, job_id: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{served.url}/#/")
    page.fill("#api-key", served.key)
    page.click("form.key-form button")
    expect(page.locator("#jobs-table")).to_be_visible()
    page.goto(f"{served.url}/#/jobs/{job_id}")
    expect(page.locator("#samples .group")).to_have_count(1)


def _texts(locator: Any) -> list[str]:
    return [t.strip() for t in locator.all_inner_texts()]


def test_an_agent_completion_opens_to_its_turns_with_tool_calls_and_results(
    served: Served, page: Any, jobs: dict[str, JobWriter]
) -> None:
    from playwright.sync_api import expect

    _open_job(page, served, jobs["agent"].job_id)
    table = page.locator("#samples table.completions")
    assert _texts(table.locator("thead th")) == [
        "#", "Reward", "m", "Advantage", "Tokens", "Finish", "Episode", "Completion"
    ]  # fmt: skip
    toggles = table.locator("button.turns-toggle")
    assert _texts(toggles) == ["▸ 4 turns", "▸ 5 turns"]
    details = table.locator("tr.transcript-row")
    expect(details.nth(0)).to_be_hidden()
    expect(details.nth(1)).to_be_hidden()

    toggles.nth(0).click()
    expect(details.nth(0)).to_be_visible()
    expect(details.nth(1)).to_be_hidden()
    assert toggles.nth(0).get_attribute("aria-expanded") == "true"
    turns = details.nth(0).locator(".turn")
    sources = [turns.nth(i).get_attribute("data-source") for i in range(turns.count())]
    assert sources == ["environment", "model", "tool", "model"]
    opening, call_turn, tool_turn, answer = (turns.nth(i) for i in range(4))
    expect(opening.locator(".turn-content")).to_have_text("Use the calculator.")
    expect(call_turn.locator(".turn-content")).to_have_text("Let me compute.")
    call = call_turn.locator(".tool-call")
    expect(call).to_have_count(1)
    expect(call.locator(".call-name")).to_have_text("multiply")
    expect(call.locator(".call-args")).to_have_text('{"a": 12, "b": 34}')
    expect(tool_turn.locator(".turn-name")).to_have_text("multiply")
    expect(tool_turn.locator(".turn-content")).to_have_text("408")
    expect(tool_turn.locator(".turn-err")).to_have_count(0)
    expect(answer.locator(".turn-content")).to_have_text("The answer is 408.")
    expect(details.nth(0).locator(".end-reason code")).to_have_text("done")
    # Each kind of turn is drawn in its own colour.
    colours = [turns.nth(i).evaluate("e => getComputedStyle(e).borderLeftColor") for i in range(3)]
    assert len(set(colours)) == 3, colours

    # The second episode: a failed call is marked as such, the environment's question shown.
    toggles.nth(1).click()
    expect(details.nth(1)).to_be_visible()
    second = details.nth(1).locator(".turn")
    sources = [second.nth(i).get_attribute("data-source") for i in range(second.count())]
    assert sources == ["model", "tool", "model", "environment", "model"]
    expect(second.nth(0).locator(".call-args")).to_have_text('{"a": 1, "b": 0}')
    failed = second.nth(1)
    assert "turn-error" in (failed.get_attribute("class") or "").split()
    expect(failed.locator(".turn-err")).to_have_text("failed: ZeroDivisionError: division by zero")
    expect(second.nth(3).locator(".turn-content")).to_have_text("Are you sure?")
    expect(details.nth(1).locator(".end-reason code")).to_have_text("error")
    # Why it ended, as the episode recorded it (the API's transcript carries end_detail).
    expect(details.nth(1).locator(".end-reason .end-detail")).to_have_text(
        " (the environment's step failed: HTTP 500)"
    )
    expect(details.nth(0).locator(".end-reason .end-detail")).to_have_count(0)
    page.locator("#rollouts").screenshot(path=str(SHOTS / "rollout-turns.png"))

    toggles.nth(0).click()  # closes again
    expect(details.nth(0)).to_be_hidden()
    assert toggles.nth(0).get_attribute("aria-expanded") == "false"


def test_a_single_turn_job_rollouts_have_no_turns(
    served: Served, page: Any, jobs: dict[str, JobWriter]
) -> None:
    from playwright.sync_api import expect

    _open_job(page, served, jobs["single"].job_id)
    table = page.locator("#samples table.completions")
    assert _texts(table.locator("thead th")) == [
        "#", "Reward", "m", "Advantage", "Tokens", "Finish", "Completion"
    ]  # fmt: skip
    expect(table.locator("tbody tr")).to_have_count(1)
    expect(table.locator("tbody pre.completion")).to_have_text("408")
    expect(table.locator("button.turns-toggle")).to_have_count(0)
    expect(table.locator("tr.transcript-row")).to_have_count(0)
