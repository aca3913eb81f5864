"""OpenAI's ``multi`` grader: named sub-graders, combined by an arithmetic formula
(:mod:`grading.expressions`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from pydantic import Field, model_validator

from grading.expressions import MAX_EXPRESSION_CHARS, ExpressionError, check_expression, evaluate
from grading.graders.base import Grader, GraderSpecBase, Item, grade_one

__all__ = ["Multi", "MultiGrader", "SubScoreError"]

if TYPE_CHECKING:
    # The union of every grader type, declared in grading.graders, which imports this module:
    # pydantic resolves the name when grading.graders rebuilds MultiGrader; mypy reads the base.
    GraderSpec = GraderSpecBase

_SUB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


class MultiGrader(GraderSpecBase):
    """OpenAI's multi: named sub-graders combined by ``calculate_output``, an arithmetic
    expression over their names (``0.7 * correct + 0.3 * format``; see grading.expressions).
    The result must lie in [0, 1] like every grader's score (outside it, the sample's grade
    counts as an error)."""

    type: Literal["multi"]
    graders: dict[str, GraderSpec] = Field(
        min_length=1, max_length=16, description="Sub-graders by the name the formula uses."
    )
    calculate_output: str = Field(
        min_length=1, max_length=MAX_EXPRESSION_CHARS, description="How their scores combine."
    )

    def sub_graders(self) -> dict[str, GraderSpecBase]:
        return dict(self.graders)

    @model_validator(mode="after")
    def _formula_over_the_sub_graders(self) -> MultiGrader:
        for key, sub in self.graders.items():
            if not _SUB_NAME.match(key):
                raise ValueError(f"sub-grader names are identifiers, got {key!r:.60}")
            if isinstance(sub, MultiGrader):
                raise ValueError(f"sub-grader {key} is a multi grader: nest one level only")
        try:
            check_expression(self.calculate_output, self.graders.keys())
        except ExpressionError as exc:
            raise ValueError(f"calculate_output: {exc}") from None
        return self

    def build(self, name: str) -> Multi:
        # Each sub-grader reports as its key; every grader is callable one sample at a time
        # (batch graders too).
        subs = {key: cast(Grader, sub.build(key)) for key, sub in self.graders.items()}
        return Multi(name, self.weight, subs, self.calculate_output)


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
