"""Graders: score completions of dataset rows (``grader(completion, item) -> [0, 1]``).

- :mod:`grading.graders.base`: the contract, verdicts, failure counting, the weighted set;
- :mod:`grading.graders.builtin`: exact match, last number, RE2 regex, length;
- :mod:`grading.graders.text`: OpenAI's string_check and text_similarity;
- :mod:`grading.graders.multi`: OpenAI's multi (sub-graders and a formula);
- :mod:`grading.graders.python`: OpenAI's python (user code in :mod:`grading.sandbox`);
- :mod:`grading.graders.math`: symbolic equivalence (math-verify, in a subprocess);
- :mod:`grading.graders.score_model`: OpenAI's score_model (a judge on an operator endpoint).
- :mod:`grading.graders.pool`: isolation, graders not known to finish in killable subprocesses.

Adding a grader type: its spec class in ``jobspec.graders`` (a ``type: Literal["<tag>"]``
field, a member of ``GraderSpecUnion``, and the traits of ``GraderSpecBase`` it differs in:
``sandboxed``, ``judge_endpoint``, ``sub_graders``), its runtime class in a module here with a
``from_spec`` constructor, and an entry in :data:`GRADER_BUILDERS` (a test checks the keys equal
the tags).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grading.graders.base import (
    MAX_GRADED_CHARS,
    BatchGrader,
    Failure,
    Graded,
    Grader,
    GraderSet,
    Item,
    ScoreBatch,
    grade_one,
)
from grading.graders.builtin import ExactMatch, LengthScore, NumericMatch, RegexMatch, last_number
from grading.graders.math import MathEquivalence, math_grader
from grading.graders.multi import Multi
from grading.graders.python import PythonGrade
from grading.graders.score_model import JudgeScore
from grading.graders.text import StringCheck, TextSimilarity
from jobspec import GraderSpecBase, grader_name, literal_tag

__all__ = [
    "GRADER_BUILDERS",
    "MAX_GRADED_CHARS",
    "BatchGrader",
    "ExactMatch",
    "Failure",
    "Graded",
    "Grader",
    "GraderSet",
    "Item",
    "JudgeScore",
    "LengthScore",
    "MathEquivalence",
    "Multi",
    "NumericMatch",
    "PythonGrade",
    "RegexMatch",
    "ScoreBatch",
    "StringCheck",
    "TextSimilarity",
    "build_grader",
    "build_graders",
    "grade_one",
    "last_number",
]

# Spec ``type`` tag -> (spec of that type, metric name) -> runtime grader. Each builder takes
# its own spec class, hence Any in the value type: build_grader picks the builder by the spec's
# own tag, and the tags identify the classes (pydantic rejects a union with a repeated tag).
# Keys must equal jobspec.GRADER_TYPES (tests/trainer/test_registries.py).
GRADER_BUILDERS: dict[str, Callable[[Any, str], Grader | BatchGrader]] = {
    "exact_match": ExactMatch.from_spec,
    "numeric_match": NumericMatch.from_spec,
    "regex": RegexMatch.from_spec,
    "length": LengthScore.from_spec,
    "string_check": StringCheck.from_spec,
    "text_similarity": TextSimilarity.from_spec,
    # Its sub-graders are built by the same registry (named by their keys in the spec).
    "multi": lambda spec, name: Multi.from_spec(spec, name, build=_build_named),
    "python": PythonGrade.from_spec,
    "math": math_grader,
    "score_model": JudgeScore.from_spec,
}


def _build_named(spec: GraderSpecBase, name: str) -> Grader | BatchGrader:
    tag = literal_tag(type(spec))
    builder = GRADER_BUILDERS.get(tag)
    if builder is None:
        raise ValueError(
            f"no grader implementation for type {tag!r}; known: {', '.join(GRADER_BUILDERS)}"
        )
    return builder(spec, name)


def build_grader(spec: GraderSpecBase) -> Grader | BatchGrader:
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
