"""The ``numeric_match`` grader: the last number of the completion against the row's answer's,
read in time linear in their length."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal

from pydantic import Field

from grading.graders.base import MAX_GRADED_CHARS, GraderSpecBase, Item, reference_answer

__all__ = ["NumericMatch", "NumericMatchGrader", "last_number"]

# A number: optional sign (not glued to a preceding word, so "x-3" reads 3 and "=-3" reads -3),
# digits with optional thousands separators, optional decimals and exponent, or ".5". A fixed
# pattern of Python's re (RE2 has no lookbehind) with no nested quantifier: linear in the text.
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-+])?"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
    r"|(?:(?<![\w.])[-+])?\.[0-9]+(?:[eE][-+]?[0-9]+)?"
)


def last_number(text: str | None) -> Decimal | None:
    """The last number written in ``text`` ("x = 1,000." -> 1000), or None if there is none.

    Decimal rather than float so that long integers compare exactly and huge exponents do not
    become inf.
    """
    if not text:
        return None
    matches = _NUMBER.findall(text[-MAX_GRADED_CHARS:])
    for raw in reversed(matches):
        try:
            value = Decimal(raw.replace(",", ""))
        except (InvalidOperation, ValueError):
            continue
        if value.is_finite():
            return value
    return None


class NumericMatchGrader(GraderSpecBase):
    """1.0 when the last number in the completion equals the reference answer's number."""

    type: Literal["numeric_match"]
    tolerance: float = Field(
        default=1e-6, ge=0, le=1e12, description="Absolute tolerance of the numeric comparison."
    )

    def build(self, name: str) -> NumericMatch:
        return NumericMatch(name, self.weight, self.tolerance)


@dataclass(frozen=True)
class NumericMatch:
    """1 when the completion's last number equals the answer's last number within tolerance."""

    name: str
    weight: float
    tolerance: float = 1e-6

    def __call__(self, completion: str, item: Item) -> float:
        expected = last_number(reference_answer(item))
        got = last_number(completion)
        if expected is None or got is None:
            return 0.0
        if got == expected:
            return 1.0
        try:
            return 1.0 if abs(got - expected) <= Decimal(repr(self.tolerance)) else 0.0
        except ArithmeticError:  # e.g. overflow of a subtraction between extreme exponents
            return 0.0
