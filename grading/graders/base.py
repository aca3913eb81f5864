"""What every grader is: its spec's base, the calling contract, a verdict, and the weighted set
that makes a reward.

Each grader type is one module of ``grading.graders``: a spec class deriving from
:class:`GraderSpecBase` (``type: Literal["<tag>"]`` and its bounded settings; a member of the
union in ``grading.graders``) whose :meth:`~GraderSpecBase.build` makes its runtime grader, and
that runtime. The validated spec is already the right class (pydantic picks it by ``type``), so
building a grader looks nothing up.

A grader scores one completion of one dataset row: ``grader(completion, item) -> float`` in
[0, 1], where ``item`` is the row's fields as the dataset gave them (``item["answer"]``,
``item["test_cases"]``, ...; ``PromptRow.item``). A grader that FAILS (raises, returns something
that is not a score in [0, 1], or runs past its time limit) scores 0 for that completion and is
counted: :class:`ScoreBatch` carries the counts, which the loop reports as
``reward/<name>/errors``, ``reward/errors`` and ``reward/timeouts``. One bad completion never
fails a training job, and never goes unnoticed.

Where graders run. Built-in graders are trusted, linear-time code on bounded input
(:data:`MAX_GRADED_CHARS`) and run inline. A grader that is not known to be bounded (user code,
symbolic math) grades whole batches itself (the :class:`BatchGrader` protocol), in a subprocess
with deadlines (``grading.graders.pool``), and :class:`GraderSet` lets it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import Field, field_validator

from grading.templates import (
    MAX_TEMPLATE_CHARS,
    check_template_field,
    render,
    sample_namespace,
)
from specbase import StrictModel, literal_tag

__all__ = [
    "MAX_GRADED_CHARS",
    "OUTPUT_TEXT",
    "BatchGrader",
    "ComparesTexts",
    "Failure",
    "Graded",
    "Grader",
    "GraderSet",
    "GraderSpecBase",
    "Item",
    "ScoreBatch",
    "TextPair",
    "grade_one",
    "grader_name",
    "reference_answer",
]

log = logging.getLogger(__name__)

# Completions are bounded by max_new_tokens, but answers and hand-built inputs are not: graders
# look at no more than this many characters (the tail, where final answers live).
MAX_GRADED_CHARS = 100_000

# A dataset row as graders see it: its fields by name (PromptRow.item).
Item = Mapping[str, Any]

# The template of the completion's text, the default ``input`` of graders that read templates.
OUTPUT_TEXT = "{{ sample.output_text }}"


class Grader(Protocol):
    """One scoring rule. ``__call__`` returns a score in [0, 1]; anything else (an exception, a
    value outside [0, 1]) is a failure, scored 0 and counted by :class:`GraderSet`."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...

    def __call__(self, completion: str, item: Item) -> float: ...


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

    def grade_batch(self, completions: Sequence[object], items: Sequence[Item]) -> list[Graded]: ...


class GraderSpecBase(StrictModel):
    """Fields every grader has, and traits the service reads instead of naming grader types.
    A subclass adds ``type: Literal["<tag>"]`` and its settings, and builds its runtime."""

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

    def build(self, name: str) -> Grader | BatchGrader:
        """The runtime grader of this spec, reporting as ``name`` (its metric name, or its key
        in a multi grader)."""
        raise NotImplementedError(f"{type(self).__name__} builds no grader")


def grader_name(grader: GraderSpecBase) -> str:
    """The grader's metric name: its ``name``, or its type tag when unnamed."""
    return grader.name or literal_tag(type(grader))


class ComparesTexts(GraderSpecBase):
    """A grader that compares two templates: ``input`` (the completion by default) against
    ``reference`` (OpenAI's field names)."""

    input: str = Field(
        default=OUTPUT_TEXT,
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the text graded, e.g. {{ sample.output_text }}.",
    )
    reference: str = Field(
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the text it is compared with, e.g. {{ item.answer }}.",
    )

    _templates = field_validator("input", "reference")(check_template_field)


@dataclass(frozen=True)
class TextPair:
    """The runtime of a :class:`ComparesTexts` grader: its two templates, rendered per sample."""

    name: str
    weight: float
    input: str
    reference: str

    def rendered(self, completion: str, item: Item) -> tuple[str, str]:
        """``input`` and ``reference`` rendered for one completion of a row."""
        sample = sample_namespace(completion)
        return (
            render(self.input, sample=sample, item=item),
            render(self.reference, sample=sample, item=item),
        )


def reference_answer(item: Item) -> str | None:
    """The row's reference answer (``item["answer"]``) when it is text, else None (no answer)."""
    answer = item.get("answer")
    return answer if isinstance(answer, str) else None


def grade_one(grader: Grader, completion: object, item: object) -> Graded:
    """Run one grader on one completion inline; any failure scores 0 and says so.

    A completion that is not a string (a careless caller) is an error; an item that is not a
    mapping is an empty row.
    """
    if not isinstance(completion, str):
        return Graded(0.0, "error")
    row: Item = item if isinstance(item, Mapping) else {}
    try:
        score = float(grader(completion, row))
    except Exception as exc:
        log.debug("grader %s raised %s: %s", getattr(grader, "name", "?"), type(exc).__name__, exc)
        return Graded(0.0, "error")
    if not 0.0 <= score <= 1.0:  # also NaN
        return Graded(0.0, "error")
    return Graded(score)


@dataclass
class ScoreBatch:
    """What scoring N completions gives: the total reward [N], each component's unweighted scores
    {name: [N]}, and per component how many of the N calls failed (``errors``, timeouts
    included) and how many of those ran out of time (``timeouts``)."""

    totals: list[float]
    components: dict[str, list[float]]
    errors: dict[str, int] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)
    # A grader's own first error message of the batch, where it keeps one (user code: the
    # exception it raised, bounded; no server paths), for the step's event.
    first_errors: dict[str, str] = field(default_factory=dict)

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
        self, completions: Sequence[str], items: Sequence[Item]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Score N completions: (total reward [N], {grader name: unweighted scores [N]})."""
        batch = self.score_batch(completions, items)
        return batch.totals, batch.components

    def score_batch(self, completions: Sequence[str], items: Sequence[Item]) -> ScoreBatch:
        """Score N completions of rows ``items``, counting each grader's failed calls (which
        score 0)."""
        if len(completions) != len(items):
            raise ValueError(f"{len(completions)} completions but {len(items)} items")
        out = ScoreBatch([0.0] * len(completions), {})
        for grader in self.graders:
            if isinstance(grader, BatchGrader):
                graded = grader.grade_batch(completions, items)
            else:
                graded = [grade_one(grader, c, i) for c, i in zip(completions, items, strict=True)]
            out.components[grader.name] = [g.score for g in graded]
            out.errors[grader.name] = sum(g.failure is not None for g in graded)
            message = getattr(grader, "first_error", None)
            if out.errors[grader.name] and isinstance(message, str):
                out.first_errors[grader.name] = message
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
