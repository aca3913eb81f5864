"""The ``math`` grader: symbolic equivalence of a final answer with math-verify."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grading.graders.base import Item
from grading.graders.pool import IsolatedGrader
from jobspec.graders import MathGrader as MathGraderSpec
from jobspec.templates import render, sample_namespace

__all__ = ["MathEquivalence", "math_grader"]

# math-verify's own time limits off (None; typed as int there): see MathEquivalence.
_OFF: Any = None


@dataclass(frozen=True)
class MathEquivalence:
    """1.0 when math-verify finds the rendered ``input``'s answer equal to ``reference``'s.
    Unbounded in time (sympy): :func:`math_grader` runs it isolated, never inline, and that
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


def math_grader(spec: MathGraderSpec, name: str) -> IsolatedGrader:
    """The grader of a ``math`` spec: :class:`MathEquivalence` in a subprocess, each check
    killed past ``spec.timeout_s`` (scored 0, counted as a timeout)."""
    inner = MathEquivalence(name, spec.weight, spec.input, spec.reference)
    return IsolatedGrader(inner, timeout_s=spec.timeout_s, batch_timeout_s=600.0)
