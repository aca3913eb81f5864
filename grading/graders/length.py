"""The ``length`` grader: full reward inside a band of lengths, falling linearly outside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from grading.graders.base import GraderSpecBase, Item

__all__ = ["MAX_LENGTH_CHARS", "LengthGrader", "LengthScore"]

MAX_LENGTH_CHARS = 1_000_000


class LengthGrader(GraderSpecBase):
    """1.0 inside [min_chars, max_chars], falling linearly to 0 over `slack_chars` outside it."""

    type: Literal["length"]
    min_chars: int = Field(
        default=0, ge=0, le=MAX_LENGTH_CHARS, description="Shortest length with full reward."
    )
    max_chars: int = Field(
        default=200, ge=1, le=MAX_LENGTH_CHARS, description="Longest length with full reward."
    )
    slack_chars: int = Field(
        default=50,
        ge=1,
        le=MAX_LENGTH_CHARS,
        description="Distance outside the range over which reward falls to 0.",
    )

    @model_validator(mode="after")
    def _range(self) -> LengthGrader:
        if self.min_chars > self.max_chars:
            raise ValueError("min_chars must be <= max_chars")
        return self

    def build(self, name: str) -> LengthScore:
        return LengthScore(name, self.weight, self.min_chars, self.max_chars, self.slack_chars)


@dataclass(frozen=True)
class LengthScore:
    """1 inside [min_chars, max_chars], linear down to 0 at ``slack_chars`` outside."""

    name: str
    weight: float
    min_chars: int
    max_chars: int
    slack_chars: int

    def __call__(self, completion: str, item: Item) -> float:
        n = len(completion)
        if n < self.min_chars:
            distance = self.min_chars - n
        elif n > self.max_chars:
            distance = n - self.max_chars
        else:
            return 1.0
        return max(0.0, 1.0 - distance / self.slack_chars)
