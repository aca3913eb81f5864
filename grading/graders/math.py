"""The ``math`` grader: symbolic equivalence of a final answer with math-verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from grading.graders.base import OUTPUT_TEXT, GraderSpecBase, Item
from grading.graders.pool import IsolatedGrader
from grading.templates import MAX_TEMPLATE_CHARS, check_template_field, render, sample_namespace

__all__ = ["MathEquivalence", "MathGrader"]


class MathGrader(GraderSpecBase):
    """1.0 when the final answer in ``input`` is mathematically equivalent to ``reference``
    (math-verify: LaTeX, fractions, decimals, sets and intervals; ``\\boxed{}`` answers first),
    checked in a subprocess under ``timeout_s`` (symbolic simplification can take unbounded
    time)."""

    type: Literal["math"]
    input: str = Field(
        default=OUTPUT_TEXT, max_length=MAX_TEMPLATE_CHARS, description="Template of the answer."
    )
    reference: str = Field(
        default="{{ item.answer }}",
        max_length=MAX_TEMPLATE_CHARS,
        description="Template of the gold answer.",
    )
    timeout_s: float = Field(default=5.0, gt=0, le=60, description="Time limit of one check.")

    _templates = field_validator("input", "reference")(check_template_field)

    def build(self, name: str) -> IsolatedGrader:
        """:class:`MathEquivalence` in a subprocess, each check killed past ``timeout_s``
        (scored 0, counted as a timeout)."""
        inner = MathEquivalence(name, self.weight, self.input, self.reference)
        return IsolatedGrader(inner, timeout_s=self.timeout_s, batch_timeout_s=600.0)


# math-verify's own time limits off (None; typed as int there): see MathEquivalence.
_OFF: Any = None


@dataclass(frozen=True)
class MathEquivalence:
    """1.0 when math-verify finds the rendered ``input``'s answer equal to ``reference``'s.
    Unbounded in time (sympy): :meth:`MathGrader.build` runs it isolated, never inline, and that
    process's deadline is its only time limit. math-verify's own (a 5 s SIGALRM per parse and
    per verify) is turned off: when it fired, math-verify swallowed it and answered "not equal",
    so a check that ran out of time scored as a wrong answer, not a timeout, and a ``timeout_s``
    above 5 s was silently 5 s."""

    name: str
    weight: float
    input: str
    reference: str

    def warm(self) -> None:
        """Import math-verify (sympy: seconds) before the first check, so the first check's
        time limit measures the check (``grading.graders.pool`` calls it before taking work)."""
        import math_verify  # noqa: F401

    def __call__(self, completion: str, item: Item) -> float:
        from math_verify import parse, verify  # sympy and friends: only where it runs

        sample = sample_namespace(completion)
        reference = render(self.reference, sample=sample, item=item)
        # A gold answer is often bare LaTeX (\\sqrt{9}); math-verify reads LaTeX inside $...$.
        gold = parse(reference, parsing_timeout=_OFF) or parse(
            f"${reference}$", parsing_timeout=_OFF
        )
        answer = parse(render(self.input, sample=sample, item=item), parsing_timeout=_OFF)
        if not gold or not answer:
            return 0.0  # nothing that reads as an answer: wrong, not an error
        return 1.0 if verify(gold, answer, timeout_seconds=_OFF) else 0.0
