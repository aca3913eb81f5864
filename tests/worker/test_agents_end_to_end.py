"""Agent jobs through the service (issue 27): submitted over HTTP, queued on Redis, recorded in
Postgres and trained by a real Celery worker process.

- A tiny agent job with a python calculator tool and a python two-turn environment succeeds,
  and the user reads its episodes in the step metrics (episode/turns, tools/calls, ...), the
  graders' and the environment's rewards, and the rollout samples.
- A job whose tools are hostile (one reads a file outside, one opens a socket, one loops
  forever, one prints 100 MB) finishes too: each of them scores 0 with its reason, which the
  user reads in the job's events, while the calculator beside them scores 1.

A random model never writes a well-formed tool call (the packaged tiny-random-llama cannot even
spell one: its 57-token vocabulary has no ``<``, ``_``, ``{`` or ``"``), so the jobs that call
tools run on a tiny random Llama with SmolLM2's tokenizer, in a model folder under the
operator's model roots, whose turns the worker scripts (tests/worker/scripted_agent_worker.py:
tests.agent_jobs.ScriptedEngine and scripted_reply, as the trainer's agent tests). The first
test also trains the packaged tiny-random-llama on the real transformers engine, unscripted.
"""

from __future__ import annotations

import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.agent_jobs import CALCULATOR, HOSTILE, TRANSCRIPT_GRADER, agent_job
from tests.conftest import Api
from tests.trainer.conftest import tiny_llama
from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.scripted_agent_worker import SCRIPTED_MODEL
from trainer.models.loading import resolve_model

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed"),
]

TERMINAL = ("succeeded", "failed", "cancelled")

# A grader per tool: 1 when the episode's calls of TOOL all returned a result; when one failed
# it raises with the tool's error, so the grader scores 0 and the step's event gives the reason.
TOOL_WORKED = """
def grade(sample, item):
    results = [c["result"] for c in sample["tool_calls"] if c["name"] == TOOL]
    if not results:
        raise RuntimeError(TOOL + " was not called")
    for result in results:
        if result.startswith("error: "):
            raise RuntimeError(result[len("error: "):])
    return 1.0
"""
# What each hostile tool's call came back with, as its grader's event reports it.
REASONS = {
    "peek": "FileNotFoundError: [Errno 2] No such file or directory: '/etc/shadow'",
    "dial": "OSError: [Errno 101] Network is unreachable",
    "spin": "the call ran out of time",
    "flood": "OSError: the sandboxed code printed more than 1048576 characters",
}


def tool_grader(name: str) -> dict[str, Any]:
    return {"type": "python", "name": name, "source": f"TOOL = {name!r}\n{TOOL_WORKED}"}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model root holding the scripted model's folder: a tiny random Llama (2 layers, width
    64) with SmolLM2's tokenizer, which can write a tool call."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    model = tiny_llama(len(tokenizer))
    model.config.max_position_embeddings = 4096  # rotary positions are computed as needed
    model.save_pretrained(root / SCRIPTED_MODEL)
    tokenizer.save_pretrained(root / SCRIPTED_MODEL)
    return root


def scripted_worker(
    api: Api, start_worker: Callable[..., WorkerProcess], model_root: Path
) -> WorkerProcess:
    """A worker of its own queue (API tests leave unconsumed messages on the session's) that
    scripts the scripted model's turns; the API and the worker allow ``model_root``."""
    api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
    api.settings.model_roots = str(model_root)
    return start_worker(
        api.settings,
        module="tests.worker.scripted_agent_worker",
        GRPO_MODEL_ROOTS=str(model_root),
    )


def submit(api: Api, spec: dict[str, Any]) -> str:
    response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def finish(api: Api, worker: WorkerProcess, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each job's final state, once every one of them has ended."""

    def ended() -> dict[str, dict[str, Any]] | None:
        jobs = {j: api.client.get(f"/v1/jobs/{j}", headers=api.headers).json() for j in job_ids}
        return jobs if all(job["status"] in TERMINAL for job in jobs.values()) else None

    try:
        final = wait_for(ended, 400, "the agent jobs to finish")
    except AssertionError:
        raise AssertionError(worker.log_tail()) from None
    assert isinstance(final, dict)
    return final


def series(api: Api, job_id: str) -> dict[str, list[float]]:
    """The job's metrics as the user reads them: each name's values over steps 1, 2."""
    body = api.client.get(f"/v1/jobs/{job_id}/metrics", headers=api.headers).json()
    assert body["steps"] == 2 and body["next_step_from"] is None, body
    out = {}
    for name in body["available"]:
        points = body["series"][name]
        assert [p["step"] for p in points] == [1, 2], name
        out[name] = [p["value"] for p in points]
    return out


def samples(api: Api, job_id: str) -> list[dict[str, Any]]:
    """Every recorded completion of the job, with its group's prompt and answer."""
    body = api.client.get(f"/v1/jobs/{job_id}/samples", headers=api.headers).json()
    assert [s["step"] for s in body["data"]] == [1, 2]
    return [
        {**c, "prompt": g["prompt"], "answer": g["answer"]}
        for s in body["data"]
        for g in s["groups"]
        for c in g["completions"]
    ]


def events(api: Api, job_id: str) -> list[dict[str, Any]]:
    body = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()
    assert not body["has_more"]
    data: list[dict[str, Any]] = body["data"]
    return data


def answered(completion: dict[str, Any]) -> str:
    """The scripted model's final answer: the product, or "unknown" (one answer in three)."""
    match = re.fullmatch(r"The answer is (\d+|unknown)\.", completion["text"])
    assert match is not None, completion["text"]
    return match.group(1)


@pytest.mark.parametrize("backend", ["postgres"])  # Postgres and Redis, the deployment's
def test_a_tiny_agent_job_with_a_calculator_and_a_two_turn_environment_succeeds(
    api: Api, start_worker: Callable[..., WorkerProcess], model_root: Path
) -> None:
    worker = scripted_worker(api, start_worker, model_root)
    grpo = {**agent_job()["grpo"], "max_new_tokens": 64}
    scripted = submit(
        api,
        agent_job(
            model=str(model_root / SCRIPTED_MODEL),
            graders=[{"type": "python", "name": "transcript", "source": TRANSCRIPT_GRADER}],
            grpo=grpo,
        ),
    )
    # The packaged tiny-random-llama, sampling for itself on the transformers engine.
    packaged = submit(api, agent_job())
    final = finish(api, worker, [scripted, packaged])
    for job in final.values():
        assert job["status"] == "succeeded", (job["error"], worker.log_tail())
        assert job["progress"]["step"] == 2

    metrics = series(api, scripted)
    # Each episode: the multiply call, an answer the environment questions, the answer again.
    assert metrics["episode/turns"] == [3.0, 3.0]
    assert metrics["tools/calls"] == [1.0, 1.0]
    assert metrics["tools/errors"] == [0.0, 0.0] and metrics["tools/malformed"] == [0.0, 0.0]
    assert metrics["episode/end/done"] == [1.0, 1.0]
    assert all(0.0 < f < 1.0 for f in metrics["episode/masked_token_frac"])
    # One answer in three is wrong: the transcript grader (right, and multiply was called) and
    # the environment (right at its second turn) agree; the total is grader + 0.5 x env.
    right = metrics["reward/transcript/mean"]
    assert right == metrics["reward/environment/mean"]
    assert all(0.0 < r < 1.0 for r in right), right
    assert metrics["reward/mean"] == pytest.approx([1.5 * r for r in right])
    assert metrics["reward/transcript/errors"] == [0.0, 0.0]
    assert any(skipped == 0.0 for skipped in metrics["update/skipped"])  # episodes trained

    completions = samples(api, scripted)
    assert completions
    for completion in completions:
        answer = answered(completion)
        expected = 1.0 if answer == completion["answer"] else 0.0
        assert answer in (completion["answer"], "unknown"), completion
        assert completion["rewards"] == {"transcript": expected, "environment": expected}
        assert completion["finish_reason"] == "stop"
    assert {c["rewards"]["transcript"] for c in completions} == {0.0, 1.0}

    # The packaged model's episodes: the same metrics, its samples recorded.
    tiny = series(api, packaged)
    for name in ("episode/turns", "tools/calls", "tools/errors", "episode/masked_token_frac"):
        assert name in tiny, name
    assert all(turns >= 1.0 for turns in tiny["episode/turns"])
    assert samples(api, packaged)


@pytest.mark.parametrize("backend", ["postgres"])
def test_hostile_tools_score_zero_with_their_reasons_and_the_job_finishes(
    api: Api, start_worker: Callable[..., WorkerProcess], model_root: Path
) -> None:
    worker = scripted_worker(api, start_worker, model_root)
    names = ["multiply", *REASONS]
    grpo = {**agent_job()["grpo"], "max_new_tokens": 256, "max_prompt_tokens": 2048}
    job_id = submit(
        api,
        agent_job(
            model=str(model_root / SCRIPTED_MODEL),
            tools=[CALCULATOR, *HOSTILE],
            graders=[tool_grader(name) for name in names],
            episode={"max_turns": 4, "max_episode_tokens": 2048, "tool_timeout_s": 2.0},
            grpo=grpo,
        ),
    )
    job = finish(api, worker, [job_id])[job_id]
    assert job["status"] == "succeeded", (job["error"], worker.log_tail())

    metrics = series(api, job_id)
    # Every episode called the five tools; the four hostile calls came back as errors.
    assert metrics["tools/calls"] == [5.0, 5.0]
    assert metrics["tools/errors"] == [4.0, 4.0]
    assert metrics["tools/malformed"] == [0.0, 0.0]
    assert metrics["episode/turns"] == [3.0, 3.0] and metrics["episode/end/done"] == [1.0, 1.0]
    per_step = 4  # prompts_per_step x group_size episodes
    assert metrics["reward/multiply/mean"] == [1.0, 1.0]
    assert metrics["reward/multiply/errors"] == [0.0, 0.0]
    for name in REASONS:
        assert metrics[f"reward/{name}/mean"] == [0.0, 0.0], name
        assert metrics[f"reward/{name}/errors"] == [per_step, per_step], name

    # Each hostile tool's reason, once a step, in the job's events (the grader raised it).
    reported = [e for e in events(api, job_id) if e["type"] == "grader"]
    expected = [
        f"step {step}: grader {name} failed on {per_step} samples (scored 0); first error: "
        f"RuntimeError: {REASONS[name]}"
        for step in (1, 2)
        for name in REASONS
    ]
    assert [e["message"] for e in reported] == expected
    for event in reported:
        name = event["data"]["grader"]
        assert event["level"] == "warning"
        first = f"RuntimeError: {REASONS[name]}"
        assert event["data"] == {"grader": name, "errors": per_step, "first": first}

    # The samples: every hostile tool scored 0, the calculator 1, and the episodes answered.
    completions = samples(api, job_id)
    assert completions
    for completion in completions:
        assert completion["rewards"] == {
            "multiply": 1.0,
            **dict.fromkeys(REASONS, 0.0),
            "environment": 1.0 if answered(completion) == completion["answer"] else 0.0,
        }
    # Each episode's transcript shows every hostile call as a failed tool turn with its reason,
    # the calculator's as a result.
    for completion in completions:
        tool_turns = [t for t in completion["transcript"]["turns"] if t["source"] == "tool"]
        assert {t["name"]: t["error"] for t in tool_turns} == {"multiply": None, **REASONS}
    # The 100 MB the flood tool printed reached no log.
    assert worker.log_path.stat().st_size < 1 << 20
