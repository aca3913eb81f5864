"""Declarative graders: score completions against reference answers.

Each grader maps (completion text, reference answer or None) to a score in [0, 1]; the reward of
a completion is the weighted sum of its graders' scores (:class:`GraderSet`). A grader never
raises on odd input (None answer, empty or huge text, unicode, numbers that do not parse): any
such case scores 0, so one malformed row cannot fail a training job.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Protocol

from trainer.config import (
    ExactMatchGrader,
    GraderSpec,
    LengthGrader,
    NumericMatchGrader,
    RegexGrader,
    grader_name,
)

__all__ = [
    "Grader",
    "GraderSet",
    "build_graders",
    "last_number",
]

# Completions are bounded by max_new_tokens, but answers and hand-built inputs are not: graders
# look at no more than this many characters (the tail, where final answers live).
MAX_GRADED_CHARS = 100_000

# A number: optional sign (not glued to a preceding word, so "x-3" reads 3 and "=-3" reads -3),
# digits with optional thousands separators, optional decimals and exponent, or ".5".
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


class Grader(Protocol):
    """One scoring rule. ``__call__`` returns a score in [0, 1] and never raises."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    def __call__(self, completion: str, answer: str | None) -> float: ...


@dataclass(frozen=True)
class ExactMatch:
    name: str
    weight: float
    case_sensitive: bool = False
    strip: bool = True

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.casefold()

    def __call__(self, completion: str, answer: str | None) -> float:
        if answer is None:
            return 0.0
        return 1.0 if self._norm(completion) == self._norm(answer) else 0.0


@dataclass(frozen=True)
class NumericMatch:
    """1 when the completion's last number equals the answer's last number within tolerance."""

    name: str
    weight: float
    tolerance: float = 1e-6

    def __call__(self, completion: str, answer: str | None) -> float:
        expected = last_number(answer)
        got = last_number(completion)
        if expected is None or got is None:
            return 0.0
        if got == expected:
            return 1.0
        try:
            return 1.0 if abs(got - expected) <= Decimal(repr(self.tolerance)) else 0.0
        except ArithmeticError:  # e.g. overflow of a subtraction between extreme exponents
            return 0.0


@dataclass(frozen=True)
class RegexMatch:
    name: str
    weight: float
    pattern: re.Pattern[str]
    full_match: bool = False

    def __call__(self, completion: str, answer: str | None) -> float:
        text = completion[-MAX_GRADED_CHARS:]
        found = self.pattern.fullmatch(text) if self.full_match else self.pattern.search(text)
        return 1.0 if found is not None else 0.0


@dataclass(frozen=True)
class LengthScore:
    """1 inside [min_chars, max_chars], linear down to 0 at ``slack_chars`` outside."""

    name: str
    weight: float
    min_chars: int
    max_chars: int
    slack_chars: int

    def __call__(self, completion: str, answer: str | None) -> float:
        n = len(completion)
        if n < self.min_chars:
            distance = self.min_chars - n
        elif n > self.max_chars:
            distance = n - self.max_chars
        else:
            return 1.0
        return max(0.0, 1.0 - distance / self.slack_chars)


def _safe(grader: Grader, completion: object, answer: object) -> float:
    """Run one grader; anything unexpected (wrong types, a pathological regex error) scores 0."""
    if not isinstance(completion, str):
        return 0.0
    ans = answer if isinstance(answer, str) else None
    try:
        score = float(grader(completion, ans))
    except Exception:
        return 0.0
    return score if math.isfinite(score) else 0.0


class GraderSet:
    """The weighted combination of graders that defines the reward of a completion."""

    def __init__(self, graders: Sequence[Grader]) -> None:
        if not graders:
            raise ValueError("at least one grader is needed")
        names = [g.name for g in graders]
        if len(set(names)) != len(names):
            raise ValueError(f"grader names must be unique, got {names}")
        self.graders: tuple[Grader, ...] = tuple(graders)

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.graders]

    @property
    def max_total(self) -> float:
        """The best reachable total: the sum of positive weights (every such grader scores 1)."""
        return sum(max(g.weight, 0.0) for g in self.graders)

    def score(
        self, completions: Sequence[str], answers: Sequence[str | None]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Score N completions: (total reward [N], {grader name: unweighted scores [N]})."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        per_grader: dict[str, list[float]] = {}
        totals = [0.0] * len(completions)
        for grader in self.graders:
            scores = [_safe(grader, c, a) for c, a in zip(completions, answers, strict=True)]
            per_grader[grader.name] = scores
            for i, s in enumerate(scores):
                totals[i] += grader.weight * s
        return totals, per_grader


def _build_one(spec: GraderSpec) -> Grader:
    name = grader_name(spec)
    if isinstance(spec, ExactMatchGrader):
        return ExactMatch(name, spec.weight, spec.case_sensitive, spec.strip)
    if isinstance(spec, NumericMatchGrader):
        return NumericMatch(name, spec.weight, spec.tolerance)
    if isinstance(spec, RegexGrader):
        return RegexMatch(name, spec.weight, re.compile(spec.pattern), spec.full_match)
    if isinstance(spec, LengthGrader):
        return LengthScore(name, spec.weight, spec.min_chars, spec.max_chars, spec.slack_chars)
    raise ValueError(f"unknown grader spec {type(spec).__name__}")


def build_graders(specs: Sequence[GraderSpec]) -> GraderSet:
    """Build the weighted grader combination of a job spec's ``graders`` list."""
    return GraderSet([_build_one(s) for s in specs])
