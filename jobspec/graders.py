"""The ``graders`` section of the job spec. Regex patterns run on RE2 (``jobspec.regex``):
validation compiles every pattern the way the grader will, so what RE2 cannot run is a 422.
"""

from __future__ import annotations

import ast
import re
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import Field, field_validator, model_validator

from jobspec.base import StrictModel, literal_tag
from jobspec.expressions import MAX_EXPRESSION_CHARS, ExpressionError, check_expression
from jobspec.python_source import parse_source
from jobspec.regex import MAX_PATTERN_CHARS, REGEX_MAX_MEM, compile_regex
from jobspec.templates import MAX_TEMPLATE_CHARS, TemplateError, check_template

__all__ = [
    "GRADER_SPECS",
    "GRADER_TYPES",
    "MAX_LENGTH_CHARS",
    "MAX_PATTERN_CHARS",
    "REGEX_MAX_MEM",
    "ExactMatchGrader",
    "GraderSpec",
    "GraderSpecBase",
    "GraderSpecUnion",
    "LengthGrader",
    "MathGrader",
    "MultiGrader",
    "NumericMatchGrader",
    "PythonGrader",
    "RegexGrader",
    "ScoreModelGrader",
    "StringCheckGrader",
    "TextSimilarityGrader",
    "compile_regex",
    "grader_name",
]

MAX_LENGTH_CHARS = 1_000_000


class GraderSpecBase(StrictModel):
    """Fields every grader has, and traits the service reads instead of naming grader types.
    A subclass adds ``type: Literal["<tag>"]`` and its settings."""

    name: str | None = Field(
        default=None,
        # Letters, digits, spaces, _ . - (OpenAI's grader names read like "Exact match"); no
        # slash, which separates the parts of a metric key.
        pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.\-]{0,63}$",
        description="Name used in per-grader metrics (reward/<name>/mean); defaults to the type.",
    )
    weight: float = Field(
        default=1.0, ge=-100, le=100, description="Weight of this grader in the total reward."
    )

    sandboxed: ClassVar[bool] = False  # runs user code in grading.sandbox: grading holds a slot

    def judge_endpoint(self) -> str | None:
        """The operator's judge endpoint it calls (GRPO_JUDGE_ENDPOINTS), if it calls one."""
        return None

    def sub_graders(self) -> dict[str, GraderSpecBase]:
        """The graders it combines, by their names (a multi grader's); none for the others."""
        return {}


class ExactMatchGrader(GraderSpecBase):
    """1.0 when the completion equals the reference answer (after optional normalisation)."""

    type: Literal["exact_match"]
    case_sensitive: bool = Field(default=False, description="Compare case-sensitively.")
    strip: bool = Field(default=True, description="Strip surrounding whitespace before comparing.")


class NumericMatchGrader(GraderSpecBase):
    """1.0 when the last number in the completion equals the reference answer's number."""

    type: Literal["numeric_match"]
    tolerance: float = Field(
        default=1e-6, ge=0, le=1e12, description="Absolute tolerance of the numeric comparison."
    )


class RegexGrader(GraderSpecBase):
    """1.0 when the pattern matches the completion (a format check)."""

    type: Literal["regex"]
    pattern: str = Field(
        min_length=1,
        max_length=MAX_PATTERN_CHARS,
        description=(
            "RE2 regular expression (https://github.com/google/re2/wiki/Syntax): Python-like "
            "syntax that matches in linear time, without lookaround or backreferences; "
            "\\d, \\w, \\s and \\b are ASCII (\\pL, \\p{Nd} are Unicode) and $ is the very end "
            "of the text (write \\s*$ to allow trailing whitespace)."
        ),
    )
    full_match: bool = Field(
        default=False, description="Require the whole completion to match, not just a part."
    )

    @field_validator("pattern")
    @classmethod
    def _runs_on_re2(cls, pattern: str) -> str:
        compile_regex(pattern)
        return pattern


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


_OUTPUT_TEXT = "{{ sample.output_text }}"


def _template(value: str) -> str:
    try:
        return check_template(value)
    except TemplateError as exc:
        raise ValueError(str(exc)) from None


class _ComparesTexts(GraderSpecBase):
    """A grader that compares two templates: ``input`` (the completion by default) against
    ``reference`` (OpenAI's field names)."""

    input: str = Field(
        default=_OUTPUT_TEXT,
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the text graded, e.g. {{ sample.output_text }}.",
    )
    reference: str = Field(
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the text it is compared with, e.g. {{ item.answer }}.",
    )

    _templates = field_validator("input", "reference")(_template)


class StringCheckGrader(_ComparesTexts):
    """OpenAI's string_check: 1.0 when ``input`` and ``reference`` (both templates) compare as
    ``operation`` says: eq (equal), ne (not equal), like (reference contained in input), ilike
    (the same, ignoring case)."""

    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"] = Field(description="How they compare.")


SIMILARITY_METRICS = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
)


class TextSimilarityGrader(_ComparesTexts):
    """OpenAI's text_similarity: the similarity of ``input`` to ``reference`` in [0, 1] by
    ``evaluation_metric`` (fuzzy_match: rapidfuzz's normalised ratio; bleu: sacrebleu's sentence
    BLEU / 100; gleu: NLTK's sentence GLEU over whitespace tokens; rouge_1..5 and rouge_l: the
    rouge-score F-measure)."""

    type: Literal["text_similarity"]
    evaluation_metric: Literal[
        "fuzzy_match",
        "bleu",
        "gleu",
        "rouge_1",
        "rouge_2",
        "rouge_3",
        "rouge_4",
        "rouge_5",
        "rouge_l",
    ] = Field(
        description=(
            "The similarity measure (OpenAI's meteor and cosine are not offered: they need "
            "WordNet data or an embedding model that an offline worker does not have)."
        )
    )
    pass_threshold: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description=(
            "Accepted for OpenAI compatibility; the reward is the similarity itself, whatever "
            "the threshold."
        ),
    )


class MultiGrader(GraderSpecBase):
    """OpenAI's multi: named sub-graders combined by ``calculate_output``, an arithmetic
    expression over their names (``0.7 * correct + 0.3 * format``; see jobspec.expressions).
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


_SUB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


_ScaleEnd = Annotated[float, Field(ge=-1e6, le=1e6)]


class JudgeMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="Who speaks.")
    type: Literal["message"] | None = Field(
        default=None, description="OpenAI's item type; accepted, always a message."
    )
    content: str = Field(
        max_length=MAX_TEMPLATE_CHARS, description="A template over sample and item."
    )

    _template = field_validator("content")(_template)


class JudgeSamplingParams(StrictModel):
    temperature: float = Field(default=0.0, ge=0, le=2, description="Judge sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Judge nucleus sampling.")
    max_completions_tokens: int = Field(
        default=256, ge=1, le=4096, description="Longest judge reply (OpenAI's name)."
    )
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1, description="Judge seed.")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        default=None, description="Sent to the judge when set (reasoning models)."
    )


class ScoreModelGrader(GraderSpecBase):
    """OpenAI's score_model: a model judges each sample. ``input`` is the judge's chat (templates
    over sample and item); its reply's score (the last number in it, or ``{"score": x}``) is
    mapped from ``range`` to [0, 1]. The judge runs on an OpenAI-compatible endpoint the
    operator configured (``endpoint`` names it: a job never carries a URL or a key)."""

    type: Literal["score_model"]
    model: str = Field(min_length=1, max_length=200, description="The judge model's name.")
    endpoint: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$",
        description="The operator's judge endpoint (GRPO_JUDGE_ENDPOINTS) to call.",
    )
    input: list[JudgeMessage] = Field(
        min_length=1, max_length=16, description="The chat sent to the judge."
    )
    range: tuple[_ScaleEnd, _ScaleEnd] = Field(
        default=(0.0, 1.0), description="The judge's score scale: [low, high] -> [0, 1]."
    )
    sampling_params: JudgeSamplingParams = Field(
        default_factory=JudgeSamplingParams, description="How the judge samples."
    )
    pass_threshold: float | None = Field(
        default=None, ge=-1e6, le=1e6, description="Accepted for OpenAI compatibility."
    )

    def judge_endpoint(self) -> str | None:
        return self.endpoint

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not low < high:
            raise ValueError("range is [low, high] with low < high")
        return value


class MathGrader(GraderSpecBase):
    """1.0 when the final answer in ``input`` is mathematically equivalent to ``reference``
    (math-verify: LaTeX, fractions, decimals, sets and intervals; ``\\boxed{}`` answers first),
    checked in a subprocess under ``timeout_s`` (symbolic simplification can take unbounded
    time)."""

    type: Literal["math"]
    input: str = Field(
        default=_OUTPUT_TEXT, max_length=MAX_TEMPLATE_CHARS, description="Template of the answer."
    )
    reference: str = Field(
        default="{{ item.answer }}",
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the gold answer.",
    )
    timeout_s: float = Field(default=5.0, gt=0, le=60, description="Time limit of one check.")

    _templates = field_validator("input", "reference")(_template)


MAX_PYTHON_SOURCE_CHARS = 64_000


class PythonGrader(GraderSpecBase):
    """OpenAI's python grader: ``source`` defines ``grade(sample, item) -> float`` in [0, 1]. It
    runs in the worker's sandbox (bubblewrap: no network, no files of the worker, an empty
    environment, CPU, memory, process and time limits; docs/graders.md); a call that raises,
    overruns or is killed scores 0 and is counted."""

    type: Literal["python"]
    sandboxed: ClassVar[bool] = True
    source: str = Field(
        min_length=1,
        max_length=MAX_PYTHON_SOURCE_CHARS,
        description="Python source defining grade(sample, item) -> float.",
    )
    image_tag: str | None = Field(
        default=None,
        max_length=64,
        description="Accepted for OpenAI compatibility; the worker's sandbox image is used.",
    )

    @field_validator("source")
    @classmethod
    def _compiles_and_defines_grade(cls, source: str) -> str:
        tree = parse_source(source, "grader.py")  # bounded: a 422, never a parser crash
        names = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        if "grade" not in names:
            raise ValueError("source must define a function grade(sample, item)")
        return source


# The one list of grader spec classes: a new grader type is a class above plus a member here
# (and its implementation in grading.graders.GRADER_BUILDERS). Everything else derives from it.
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
MultiGrader.model_rebuild()


def grader_name(grader: GraderSpecBase) -> str:
    """The grader's metric name: its ``name``, or its type tag when unnamed."""
    return grader.name or literal_tag(type(grader))
