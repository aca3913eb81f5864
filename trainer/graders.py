"""Declarative graders: score completions against reference answers.

Each grader maps (completion text, reference answer or None) to a score in [0, 1]; the reward of
a completion is the weighted sum of its graders' scores (:class:`GraderSet`). Odd input (None
answer, empty or huge text, unicode, numbers that do not parse) simply scores what it scores,
usually 0. A grader that FAILS (raises, returns something that is not a score in [0, 1], or runs
past its time limit) scores 0 for that completion and is counted: :class:`ScoreBatch` carries the
counts, which the loop reports as ``reward/<name>/errors``, ``reward/errors`` and
``reward/timeouts``. One bad completion never fails a training job, and never goes unnoticed.

Where graders run. The built-in graders below are trusted linear-time code on bounded input
(:data:`MAX_GRADED_CHARS`): exact match, the number scan, length, and regexes on RE2, which
cannot backtrack and releases the GIL while it matches. They run inline. A grader that is not
known to be bounded (arbitrary Python, as issue 12 adds) must be wrapped in
``trainer.grader_pool.IsolatedGrader``: it then runs in a spawned subprocess with a per-call
and a per-batch deadline, and a call past its deadline kills the process (a GIL-holding loop
cannot be interrupted any other way). :class:`GraderSet` runs any grader with a
``grade_batch`` method (the :class:`BatchGrader` protocol) that way, the others inline.

Adding a grader type: its spec class in ``trainer.spec.graders`` (a ``type: Literal["<tag>"]``
field, and a member of ``GraderSpecUnion``), its runtime class here with a ``from_spec``
constructor, and an entry in :data:`GRADER_BUILDERS` (a test checks the keys equal the tags).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from trainer.config import (
    ExactMatchGrader,
    GraderSpecBase,
    LengthGrader,
    NumericMatchGrader,
    RegexGrader,
    compile_regex,
    grader_name,
    literal_tag,
)

__all__ = [
    "GRADER_BUILDERS",
    "MAX_GRADED_CHARS",
    "BatchGrader",
    "Failure",
    "Graded",
    "Grader",
    "GraderSet",
    "ScoreBatch",
    "build_grader",
    "build_graders",
    "grade_one",
    "last_number",
]

log = logging.getLogger(__name__)

# Completions are bounded by max_new_tokens, but answers and hand-built inputs are not: graders
# look at no more than this many characters (the tail, where final answers live).
MAX_GRADED_CHARS = 100_000

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


class Grader(Protocol):
    """One scoring rule. ``__call__`` returns a score in [0, 1]; anything else (an exception, a
    value outside [0, 1]) is a failure, scored 0 and counted by :class:`GraderSet`."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    def __call__(self, completion: str, answer: str | None) -> float: ...


Failure = Literal["error", "timeout"]


class Graded(NamedTuple):
    """One grader's verdict on one completion: a score, and why it is 0 when the grader failed."""

    score: float
    failure: Failure | None = None


@runtime_checkable
class BatchGrader(Protocol):
    """A grader that grades a whole batch itself (e.g. in a subprocess, under deadlines)."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    def grade_batch(
        self, completions: Sequence[object], answers: Sequence[object]
    ) -> list[Graded]: ...


def grade_one(grader: Grader, completion: object, answer: object) -> Graded:
    """Run one grader on one completion inline; any failure scores 0 and says so.

    A completion that is not a string (a careless caller) is an error; an answer that is not a
    string is no answer.
    """
    if not isinstance(completion, str):
        return Graded(0.0, "error")
    ans = answer if isinstance(answer, str) else None
    try:
        score = float(grader(completion, ans))
    except Exception as exc:
        log.debug("grader %s raised %s: %s", getattr(grader, "name", "?"), type(exc).__name__, exc)
        return Graded(0.0, "error")
    if not 0.0 <= score <= 1.0:  # also NaN
        return Graded(0.0, "error")
    return Graded(score)


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

    @classmethod
    def from_spec(cls, spec: NumericMatchGrader, name: str) -> NumericMatch:
        return cls(name, spec.weight, spec.tolerance)

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


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass(frozen=True)
class RegexMatch:
    """1 when the RE2 ``pattern`` is found in the completion (``search``), or matches all of it
    (``full_match``). RE2 syntax and semantics: see ``trainer.spec.graders``."""

    name: str
    weight: float
    pattern: Any  # an RE2 pattern (trainer.config.compile_regex)
    full_match: bool = False

    @classmethod
    def from_spec(cls, spec: RegexGrader, name: str) -> RegexMatch:
        return cls(name, spec.weight, compile_regex(spec.pattern), spec.full_match)

    @classmethod
    def of(cls, name: str, pattern: str, *, weight: float = 1.0, full: bool = False) -> RegexMatch:
        """A regex grader from a pattern string (ValueError if RE2 cannot run it)."""
        return cls(name, weight, compile_regex(pattern), full)

    def __call__(self, completion: str, answer: str | None) -> float:
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

    def __call__(self, completion: str, answer: str | None) -> float:
        n = len(completion)
        if n < self.min_chars:
            distance = self.min_chars - n
        elif n > self.max_chars:
            distance = n - self.max_chars
        else:
            return 1.0
        return max(0.0, 1.0 - distance / self.slack_chars)


@dataclass
class ScoreBatch:
    """What scoring N completions gives: the total reward [N], each component's unweighted scores
    {name: [N]}, and per component how many of the N calls failed (``errors``, timeouts
    included) and how many of those ran out of time (``timeouts``)."""

    totals: list[float]
    components: dict[str, list[float]]
    errors: dict[str, int] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def without_failures(
        cls, totals: list[float], components: dict[str, list[float]]
    ) -> ScoreBatch:
        """A batch from a scorer that cannot fail quietly (its failures raise)."""
        return cls(totals, components, dict.fromkeys(components, 0), dict.fromkeys(components, 0))


class GraderSet:
    """The weighted combination of graders that defines the reward of a completion."""

    def __init__(self, graders: Sequence[Grader | BatchGrader]) -> None:
        if not graders:
            raise ValueError("at least one grader is needed")
        names = [g.name for g in graders]
        if len(set(names)) != len(names):
            raise ValueError(f"grader names must be unique, got {names}")
        self.graders: tuple[Grader | BatchGrader, ...] = tuple(graders)

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
        batch = self.score_batch(completions, answers)
        return batch.totals, batch.components

    def score_batch(self, completions: Sequence[str], answers: Sequence[str | None]) -> ScoreBatch:
        """Score N completions, counting each grader's failed calls (which score 0)."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        out = ScoreBatch([0.0] * len(completions), {})
        for grader in self.graders:
            if isinstance(grader, BatchGrader):
                graded = grader.grade_batch(completions, answers)
            else:
                graded = [
                    grade_one(grader, c, a) for c, a in zip(completions, answers, strict=True)
                ]
            out.components[grader.name] = [g.score for g in graded]
            out.errors[grader.name] = sum(g.failure is not None for g in graded)
            out.timeouts[grader.name] = sum(g.failure == "timeout" for g in graded)
            if out.errors[grader.name]:
                log.warning(
                    "grader %s failed on %d of %d completions (%d timeouts); scored 0",
                    grader.name,
                    out.errors[grader.name],
                    len(graded),
                    out.timeouts[grader.name],
                )
            for i, g in enumerate(graded):
                out.totals[i] += grader.weight * g.score
        return out

    def close(self) -> None:
        """Stop the subprocesses of isolated graders (they also stop when this is collected)."""
        for grader in self.graders:
            close = getattr(grader, "close", None)
            if callable(close):
                close()


# Spec ``type`` tag -> (spec of that type, metric name) -> runtime grader. Each builder takes
# its own spec class, hence Any in the value type: build_grader picks the builder by the spec's
# own tag, and the tags identify the classes (pydantic rejects a union with a repeated tag).
# Keys must equal trainer.config.GRADER_TYPES (tests/trainer/test_registries.py).
GRADER_BUILDERS: dict[str, Callable[[Any, str], Grader]] = {
    "exact_match": ExactMatch.from_spec,
    "numeric_match": NumericMatch.from_spec,
    "regex": RegexMatch.from_spec,
    "length": LengthScore.from_spec,
}


def build_grader(spec: GraderSpecBase) -> Grader:
    """The runtime grader of one validated grader spec (any member of ``GraderSpecUnion``)."""
    tag = literal_tag(type(spec))
    builder = GRADER_BUILDERS.get(tag)
    if builder is None:
        raise ValueError(
            f"no grader implementation for type {tag!r}; known: {', '.join(GRADER_BUILDERS)}"
        )
    return builder(spec, grader_name(spec))


def build_graders(specs: Sequence[GraderSpecBase]) -> GraderSet:
    """Build the weighted grader combination of a job spec's ``graders`` list."""
    return GraderSet([build_grader(s) for s in specs])
