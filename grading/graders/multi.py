"""OpenAI's ``multi`` grader: named sub-graders, combined by an arithmetic formula."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from grading.graders.base import BatchGrader, Grader, Item, grade_one
from jobspec.expressions import evaluate
from jobspec.graders import MultiGrader as MultiGraderSpec

__all__ = ["Multi", "SubScoreError"]


class SubScoreError(ValueError):
    """A sub-grader failed: the combination has no value for this sample."""


@dataclass(frozen=True)
class Multi:
    """``calculate_output`` over the sub-graders' scores (each in [0, 1]). A failing sub-grader
    fails the whole grade (scored 0 and counted, like any grader error)."""

    name: str
    weight: float
    graders: Mapping[str, Grader]
    formula: str

    @classmethod
    def from_spec(
        cls, spec: MultiGraderSpec, name: str, *, build: Callable[[Any, str], Grader | BatchGrader]
    ) -> Multi:
        # Every grader is callable one sample at a time (batch graders too).
        subs = {key: cast(Grader, build(sub, key)) for key, sub in spec.graders.items()}
        return cls(name, spec.weight, subs, spec.calculate_output)

    def sub_scores(self, completion: str, item: Item) -> dict[str, float]:
        """Each sub-grader's score of this sample; SubScoreError naming the first that failed."""
        scores = {}
        for key, grader in self.graders.items():
            graded = grade_one(grader, completion, item)
            if graded.failure is not None:
                raise SubScoreError(f"sub-grader {key} failed ({graded.failure})")
            scores[key] = graded.score
        return scores

    def __call__(self, completion: str, item: Item) -> float:
        return evaluate(self.formula, self.sub_scores(completion, item))
