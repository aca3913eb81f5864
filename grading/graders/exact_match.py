"""The ``exact_match`` grader: 1 when the completion equals the row's ``answer``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from grading.graders.base import GraderSpecBase, Item, reference_answer

__all__ = ["ExactMatch", "ExactMatchGrader"]


class ExactMatchGrader(GraderSpecBase):
    """1.0 when the completion equals the reference answer (after optional normalisation)."""

    type: Literal["exact_match"]
    case_sensitive: bool = Field(default=False, description="Compare case-sensitively.")
    strip: bool = Field(default=True, description="Strip surrounding whitespace before comparing.")

    def build(self, name: str) -> ExactMatch:
        return ExactMatch(name, self.weight, self.case_sensitive, self.strip)


@dataclass(frozen=True)
class ExactMatch:
    name: str
    weight: float
    case_sensitive: bool = False
    strip: bool = True

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.casefold()

    def __call__(self, completion: str, item: Item) -> float:
        answer = reference_answer(item)
        if answer is None:
            return 0.0
        return 1.0 if self._norm(completion) == self._norm(answer) else 0.0
