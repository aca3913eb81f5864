"""Try a grader before spending a GPU: run one on one sample and one row, or only check it.

The grader runs in the API process exactly as on a worker (the same ``trainer.graders``
classes); a ``python`` grader runs in the same sandbox, one sandbox started for the request and
stopped after it (``GRPO_SANDBOX_*`` apply). Graders are bounded by construction (RE2, length
caps, the sandbox's limits), so a request cannot hold the API longer than a grader's own limit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from trainer.config import GraderSpecBase, grader_name, literal_tag
from trainer.graders import Grader, Multi, build_grader, grade_one
from trainer.graders.python import PythonGrade
from trainer.sandbox import build_sandbox_settings

__all__ = ["GraderRun", "run_grader"]


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


def run_grader(spec: GraderSpecBase, completion: str, item: Mapping[str, Any]) -> GraderRun:
    """Run the validated grader ``spec`` on ``completion`` of row ``item``; never raises for
    what the grader does (a failure is the result's ``failure`` and ``message``)."""
    grader = build_grader(spec)
    if isinstance(grader, PythonGrade):
        grader.settings = build_sandbox_settings(processes=1)
    started = time.perf_counter()
    sub_rewards: dict[str, float] = {}
    message: str | None = None
    try:
        if isinstance(grader, Multi):
            try:
                sub_rewards = grader.sub_scores(completion, item)
            except ValueError as exc:
                message = str(exc)
        if isinstance(grader, PythonGrade):
            graded = grader.grade_batch([completion], [item])[0]
            message = grader.first_error
        else:
            inline = cast(Grader, grader)  # every grader but python's grades inline
            graded = grade_one(inline, completion, item)
            if graded.failure is not None and message is None:
                message = _why(grader, completion, item)
    finally:
        close = getattr(grader, "close", None)
        if callable(close):
            close()
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


def _why(grader: Any, completion: str, item: Mapping[str, Any]) -> str:
    """The reason an inline grader failed: its exception, or the value it returned."""
    try:
        value = grader(completion, item)
    except Exception as exc:  # the grader's own error: shown to the tenant who wrote it
        return f"{type(exc).__name__}: {exc}"[:500]
    return f"the grader returned {value!r:.60}, not a score in [0, 1]"
