"""The ``checkpoint`` section of the job spec: which checkpoints a job keeps, and the rule.

A job keeps its last ``keep_last`` checkpoints plus the best one by the metric ``keep_best_by``
(``best_mode`` max or min), and deletes the others as new ones arrive. :meth:`CheckpointSpec.
kept_steps` is that rule, declared once: the trainer applies it to its own output folder when it
runs as a library (``grpo train``), the service's worker applies it to the job's recorded
checkpoints (and their folders) instead. The newest checkpoint is always kept: a resume needs it.

How often a checkpoint is written stays the top-level ``checkpoint_interval`` (older specs keep
working unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from jobspec.base import MAX_STEPS
from specbase import StrictModel

__all__ = ["METRIC_NAME_PATTERN", "BestMode", "CheckpointSpec"]

# A metric key as the trainer reports them: parts separated by ``/``, each starting with a letter
# or digit, then letters, digits and ``_ . -`` (and spaces after the first part: a grader's name
# may hold them), e.g. ``eval/accuracy`` or ``reward/Exact match/mean``.
METRIC_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_. \-]*)*$"
MAX_METRIC_NAME_CHARS = 200

BestMode = Literal["max", "min"]


class CheckpointSpec(StrictModel):
    """Which of a job's checkpoints are kept on disk (the others are deleted)."""

    keep_last: int | None = Field(
        default=3,
        ge=1,
        le=MAX_STEPS,
        description="Keep the newest N checkpoints (null: keep every checkpoint). The newest "
        "one is always kept: a resume starts from it.",
    )
    keep_best_by: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_METRIC_NAME_CHARS,
        pattern=METRIC_NAME_PATTERN,
        description="Also keep the checkpoint with the best value of this metric (e.g. "
        "eval/accuracy), its latest value at or before the checkpoint's step. Checkpoints "
        "saved before the metric was first reported are never the best.",
    )
    best_mode: BestMode = Field(
        default="max", description="Whether the best value of keep_best_by is the max or the min."
    )

    def kept_steps(self, checkpoints: Iterable[tuple[int, float | None]]) -> set[int]:
        """The steps to keep among ``checkpoints``, given as ``(step, value)``: ``value`` is
        ``keep_best_by``'s latest value at or before that step (None when it had none yet or
        the value is not finite). Returns the newest ``keep_last`` steps (all with None) plus
        the best step by value; among equal best values the oldest wins: it is the one that
        reached it (with evaluation every few steps, the checkpoints after an evaluation carry
        its value until the next, but only the first was evaluated). Empty input: empty."""
        found = sorted({step: value for step, value in checkpoints}.items())
        if not found:
            return set()
        steps = [step for step, _ in found]
        kept = set(steps if self.keep_last is None else steps[-self.keep_last :])
        if self.keep_best_by is not None:
            scored = [(v, s) for s, v in found if v is not None and math.isfinite(v)]
            if scored:
                sign = 1.0 if self.best_mode == "max" else -1.0
                kept.add(max(scored, key=lambda vs: (sign * vs[0], -vs[1]))[1])
        return kept
