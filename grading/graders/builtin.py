"""The built-in graders: exact match, the last number, an RE2 regex, a length band. Each reads
the completion and the row's ``answer`` (``item["answer"]``), in time linear in their length."""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from grading.graders.base import MAX_GRADED_CHARS, Item
from jobspec import (
    ExactMatchGrader,
    LengthGrader,
    NumericMatchGrader,
    RegexGrader,
    compile_regex,
)

__all__ = ["ExactMatch", "LengthScore", "NumericMatch", "RegexMatch", "last_number"]

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


def _answer(item: Item) -> str | None:
    """The row's reference answer when it is text, else None (no answer)."""
    answer = item.get("answer")
    return answer if isinstance(answer, str) else None


@dataclass(frozen=True)
class ExactMatch:
    name: str
    weight: float
    case_sensitive: bool = False
    strip: bool = True

    @classmethod
    def from_spec(cls, spec: ExactMatchGrader, name: str) -> ExactMatch:
        return cls(name, spec.weight, spec.case_sensitive, spec.strip)

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.casefold()

    def __call__(self, completion: str, item: Item) -> float:
        answer = _answer(item)
        if answer is None:
            return 0.0
        return 1.0 if self._norm(completion) == self._norm(answer) else 0.0


@dataclass(frozen=True)
class NumericMatch:
    """1 when the completion's last number equals the answer's last number within tolerance."""

    name: str
    weight: float
    tolerance: float = 1e-6

    @classmethod
    def from_spec(cls, spec: NumericMatchGrader, name: str) -> NumericMatch:
        return cls(name, spec.weight, spec.tolerance)

    def __call__(self, completion: str, item: Item) -> float:
        expected = last_number(_answer(item))
        got = last_number(completion)
        if expected is None or got is None:
            return 0.0
        if got == expected:
            return 1.0
        try:
            return 1.0 if abs(got - expected) <= Decimal(repr(self.tolerance)) else 0.0
        except ArithmeticError:  # e.g. overflow of a subtraction between extreme exponents
            return 0.0


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass(frozen=True)
class RegexMatch:
    """1 when the RE2 ``pattern`` is found in the completion (``search``), or matches all of it
    (``full_match``). RE2 syntax and semantics: see ``jobspec.graders``."""

    name: str
    weight: float
    pattern: Any  # an RE2 pattern (jobspec.compile_regex)
    full_match: bool = False

    @classmethod
    def from_spec(cls, spec: RegexGrader, name: str) -> RegexMatch:
        return cls(name, spec.weight, compile_regex(spec.pattern), spec.full_match)

    @classmethod
    def of(cls, name: str, pattern: str, *, weight: float = 1.0, full: bool = False) -> RegexMatch:
        """A regex grader from a pattern string (ValueError if RE2 cannot run it)."""
        return cls(name, weight, compile_regex(pattern), full)

    def __call__(self, completion: str, item: Item) -> float:
        text = completion[-MAX_GRADED_CHARS:]
        try:
            found = self._match(text)
        except UnicodeEncodeError:
            found = self._match(_utf8(text))
        return 1.0 if found is not None else 0.0

    def _match(self, text: str) -> object:
        return self.pattern.fullmatch(text) if self.full_match else self.pattern.search(text)


@dataclass(frozen=True)
class LengthScore:
    """1 inside [min_chars, max_chars], linear down to 0 at ``slack_chars`` outside."""

    name: str
    weight: float
    min_chars: int
    max_chars: int
    slack_chars: int

    @classmethod
    def from_spec(cls, spec: LengthGrader, name: str) -> LengthScore:
        return cls(name, spec.weight, spec.min_chars, spec.max_chars, spec.slack_chars)

    def __call__(self, completion: str, item: Item) -> float:
        n = len(completion)
        if n < self.min_chars:
            distance = self.min_chars - n
        elif n > self.max_chars:
            distance = n - self.max_chars
        else:
            return 1.0
        return max(0.0, 1.0 - distance / self.slack_chars)
