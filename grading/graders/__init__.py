"""Graders: score completions of dataset rows (``grader(completion, item) -> [0, 1]``).

Each grader type is one module holding its spec class (the job spec's ``graders`` entry of that
``type``) and its runtime, which the spec builds (``spec.build(name)``):

- :mod:`grading.graders.exact_match`, :mod:`~grading.graders.numeric_match` (the last number),
  :mod:`~grading.graders.regex` (RE2), :mod:`~grading.graders.length`;
- :mod:`~grading.graders.string_check` and :mod:`~grading.graders.text_similarity`: OpenAI's
  text graders, over templates of the sample and the row (:mod:`grading.templates`);
- :mod:`~grading.graders.multi`: OpenAI's multi (sub-graders and a formula);
- :mod:`~grading.graders.python`: OpenAI's python (user code in :mod:`grading.sandbox`);
- :mod:`~grading.graders.math`: symbolic equivalence (math-verify, in a subprocess);
- :mod:`~grading.graders.score_model`: OpenAI's score_model (a judge on an operator endpoint).

Beside them: :mod:`grading.graders.base` (the spec base, the calling contract, verdicts, failure
counting, the weighted set) and :mod:`grading.graders.pool` (isolation: graders not known to
finish, in killable subprocesses).

Adding a grader type: its module here (a spec class deriving from ``GraderSpecBase`` with a
``type: Literal["<tag>"]`` field, bounded settings, the traits it differs in (``sandboxed``,
``judge_endpoint``, ``sub_graders``) and ``build``; its runtime with ``__call__(completion,
item)``, or ``grade_batch`` for graders that must run isolated), its member of
:data:`GraderSpecUnion` below, and its test. The job spec (``jobspec``) re-exports the union.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, get_args

from pydantic import Field

from grading.graders.base import (
    MAX_GRADED_CHARS,
    BatchGrader,
    Failure,
    Graded,
    Grader,
    GraderSet,
    GraderSpecBase,
    Item,
    ScoreBatch,
    grade_one,
    grader_name,
)
from grading.graders.exact_match import ExactMatch, ExactMatchGrader
from grading.graders.length import LengthGrader, LengthScore
from grading.graders.math import MathEquivalence, MathGrader
from grading.graders.multi import Multi, MultiGrader
from grading.graders.numeric_match import NumericMatch, NumericMatchGrader, last_number
from grading.graders.python import PythonGrade, PythonGrader
from grading.graders.regex import RegexGrader, RegexMatch
from grading.graders.score_model import JudgeScore, ScoreModelGrader
from grading.graders.string_check import StringCheck, StringCheckGrader
from grading.graders.text_similarity import TextSimilarity, TextSimilarityGrader
from specbase import literal_tag

__all__ = [
    "GRADER_SPECS",
    "GRADER_TYPES",
    "MAX_GRADED_CHARS",
    "BatchGrader",
    "ExactMatch",
    "ExactMatchGrader",
    "Failure",
    "Graded",
    "Grader",
    "GraderSet",
    "GraderSpec",
    "GraderSpecBase",
    "GraderSpecUnion",
    "Item",
    "JudgeScore",
    "LengthGrader",
    "LengthScore",
    "MathEquivalence",
    "MathGrader",
    "Multi",
    "MultiGrader",
    "NumericMatch",
    "NumericMatchGrader",
    "PythonGrade",
    "PythonGrader",
    "RegexGrader",
    "RegexMatch",
    "ScoreBatch",
    "ScoreModelGrader",
    "StringCheck",
    "StringCheckGrader",
    "TextSimilarity",
    "TextSimilarityGrader",
    "build_grader",
    "build_graders",
    "grade_one",
    "grader_name",
    "last_number",
]

# The one list of grader types: a new type is its module above plus a member here. Pydantic
# picks the member by its ``type`` tag (and rejects a union with a repeated tag); everything
# else (GRADER_TYPES, the API's error paths, the JSON schema) derives from it.
GraderSpecUnion = (
    ExactMatchGrader
    | NumericMatchGrader
    | RegexGrader
    | LengthGrader
    | StringCheckGrader
    | TextSimilarityGrader
    | MultiGrader
    | PythonGrader
    | MathGrader
    | ScoreModelGrader
)
GraderSpec = Annotated[GraderSpecUnion, Field(discriminator="type")]
GRADER_SPECS: tuple[type[GraderSpecBase], ...] = get_args(GraderSpecUnion)
GRADER_TYPES: tuple[str, ...] = tuple(literal_tag(cls) for cls in GRADER_SPECS)
MultiGrader.model_rebuild(_types_namespace={"GraderSpec": GraderSpec})  # its sub-graders


def build_grader(spec: GraderSpecBase) -> Grader | BatchGrader:
    """The runtime grader of one validated grader spec (any member of ``GraderSpecUnion``),
    reporting as its metric name."""
    return spec.build(grader_name(spec))


def build_graders(specs: Sequence[GraderSpecBase]) -> GraderSet:
    """Build the weighted grader combination of a job spec's ``graders`` list."""
    return GraderSet([build_grader(s) for s in specs])
