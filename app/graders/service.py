"""Try a grader before spending a GPU: run one on one sample and one row, or only check it.

The grader runs in the API process exactly as on a worker (the same ``grading.graders``
classes); a ``python`` grader runs in the same sandbox, one sandbox at a time for the request,
started for it and stopped after it (``GRPO_SANDBOX_*`` apply). Graders are bounded by
construction (RE2, length caps, the sandbox's and the math grader's time limits), so a request
cannot hold the API longer than a grader's own limit.

Sandboxes are a shared, bounded resource of the API process (``grading.sandbox.capacity``): a
request with python in it holds one slot of ``AppState.sandboxes`` while it grades, under its
project's cap. No slot within the queue's bounds and time limit is a 429 with Retry-After when
the project is at its own cap, else a 503 with Retry-After; either names the limit. A request
never waits for a second slot while it holds one (a multi grader's python sub-graders run one
after another in the request's slot), so requests cannot deadlock on each other's slots.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from app.core.capacity import held_slot
from app.jobs.admission import admit_judge
from grading.graders import BatchGrader, Grader, Multi, build_grader, grade_one
from grading.graders.python import PythonGrade
from grading.sandbox import SandboxCapacity, build_sandbox_settings
from jobspec import GraderSpecBase, grader_name, literal_tag

__all__ = ["GraderRun", "run_grader", "validate_grader"]


@dataclass(frozen=True)
class GraderRun:
    """What running a grader on one sample gave (OpenAI's grader-run shape, see the route)."""

    reward: float
    name: str
    type: str
    execution_time: float
    failure: str | None = None
    message: str | None = None
    sub_rewards: dict[str, float] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)


def validate_grader(spec: GraderSpecBase) -> None:
    """What a schema-valid grader may still not ask of this service (InvalidRequest, 422
    naming the field under ``grader``): the rules job submission applies to each grader."""
    admit_judge(spec, path="grader")


def run_grader(
    spec: GraderSpecBase,
    completion: str,
    item: Mapping[str, Any],
    *,
    sandboxes: SandboxCapacity,
    project_id: str,
) -> GraderRun:
    """Run the validated grader ``spec`` on ``completion`` of row ``item``; never raises for
    what the grader does (a failure is the result's ``failure`` and ``message``). Raises
    TooManyRequests or Overloaded when its python needs a sandbox and none is free."""
    validate_grader(spec)
    grader = build_grader(spec)
    sandboxed = list(_sandboxed(spec, grader))
    try:
        with _sandbox_slot(sandboxes, project_id, needed=bool(sandboxed)) as slot:
            for each in sandboxed:
                each.settings = build_sandbox_settings(processes=1)
                each.slot = slot
            return _run(spec, grader, completion, item)
    finally:
        close = getattr(grader, "close", None)
        if callable(close):
            close()
        for each in sandboxed:
            each.close()


def _run(
    spec: GraderSpecBase, grader: Grader | BatchGrader, completion: str, item: Mapping[str, Any]
) -> GraderRun:
    started = time.perf_counter()
    sub_rewards: dict[str, float] = {}
    message: str | None = None
    if isinstance(grader, Multi):
        try:
            sub_rewards = grader.sub_scores(completion, item)
        except ValueError as exc:
            message = str(exc)
    if isinstance(grader, BatchGrader):
        # Python, math (in its subprocess, under its time limit), score_model: the batch path
        # reports a timeout as one, with the grader's reason.
        graded = grader.grade_batch([completion], [item])[0]
        message = getattr(grader, "first_error", None)
    else:
        graded = grade_one(cast(Grader, grader), completion, item)
        if graded.failure is not None and message is None:
            message = _why(grader, completion, item)
    name = grader_name(spec)
    return GraderRun(
        reward=graded.score,
        name=name,
        type=literal_tag(type(spec)),
        execution_time=time.perf_counter() - started,
        failure=graded.failure,
        message=message,
        sub_rewards=sub_rewards,
        scores={name: graded.score, **sub_rewards},
    )


def _sandboxed(spec: GraderSpecBase, grader: object) -> Iterator[PythonGrade]:
    """The runtime graders of ``spec`` that grade in a sandbox (the spec's ``sandboxed`` trait):
    itself, or a multi grader's sub-graders (built under the names of ``spec.sub_graders``)."""
    if spec.sandboxed:
        yield cast(PythonGrade, grader)
    subs = spec.sub_graders()
    if subs:
        built = cast(Multi, grader).graders
        for key, sub in subs.items():
            yield from _sandboxed(sub, built[key])


@contextlib.contextmanager
def _sandbox_slot(
    sandboxes: SandboxCapacity, project_id: str, *, needed: bool
) -> Iterator[int | None]:
    """One sandbox slot of the process for the request (none when it runs no python); no slot,
    or a sandbox the host refused to start, is the project's 429 or the process's 503."""
    if not needed:
        yield None
        return
    with held_slot(sandboxes, project_id, param="grader") as slot:
        yield slot


def _why(grader: Any, completion: str, item: Mapping[str, Any]) -> str:
    """The reason an inline grader failed: its exception, or the value it returned."""
    try:
        value = grader(completion, item)
    except Exception as exc:  # the grader's own error: shown to the tenant who wrote it
        return f"{type(exc).__name__}: {exc}"[:500]
    return f"the grader returned {value!r:.60}, not a score in [0, 1]"
