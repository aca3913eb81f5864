"""OpenAI's ``python`` grader: the user's ``grade(sample, item)``, run in the sandbox pool."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from grading.graders.base import Graded, GraderSpecBase, Item
from grading.python_source import parse_source
from grading.sandbox import SandboxBusy, SandboxError, SandboxPool, build_sandbox_settings
from grading.sandbox.settings import SandboxSettings
from grading.templates import sample_namespace

__all__ = ["MAX_PYTHON_SOURCE_CHARS", "PythonGrade", "PythonGrader"]

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

    def build(self, name: str) -> PythonGrade:
        return PythonGrade(name, self.weight, self.source)


@dataclass
class PythonGrade:
    """A BatchGrader: each batch goes to :class:`~grading.sandbox.SandboxPool` (started on the
    first batch). ``first_error`` holds the first grader error of the latest batch (bounded, no
    host paths: it is the user's own exception), which the loop reports as an event.

    On a worker (``slot`` None) the pool takes the process's sandbox slots and keeps its
    sandboxes between batches; no sandbox (no free slot, or the host refused one) fails the
    batch's samples with the reason, like any sandbox error. For one request (the API), the
    caller holds a ``slot`` of its process's capacity (under its project's cap): each batch runs
    one sandbox in it, and SandboxBusy propagates (the caller answers 503: nothing was graded)."""

    name: str
    weight: float
    source: str
    settings: SandboxSettings = field(default_factory=build_sandbox_settings)
    first_error: str | None = None
    slot: int | None = None
    _pool: SandboxPool | None = None

    def grade_batch(self, completions: Sequence[object], items: Sequence[Item]) -> list[Graded]:
        if len(completions) != len(items):
            raise ValueError(f"{len(completions)} completions but {len(items)} items")
        self.first_error = None
        texts = [c if isinstance(c, str) else "" for c in completions]
        try:
            if self._pool is None:
                self._pool = SandboxPool(self.source, self.settings, slot=self.slot)
            verdicts = self._pool.grade(
                [sample_namespace(t) for t in texts], [dict(i) for i in items]
            )
        except SandboxError as exc:
            if isinstance(exc, SandboxBusy) and self.slot is not None:
                raise
            # The grader cannot run at all (no sandbox here, or its source does not load):
            # every sample fails, counted, and the reason is the step's event.
            self.first_error = str(exc)
            return [Graded(0.0, "error") for _ in texts]
        out = []
        for text, verdict in zip(completions, verdicts, strict=True):
            graded = Graded(verdict.score, verdict.failure)
            if not isinstance(text, str):
                graded = Graded(0.0, "error")
            if graded.failure is not None and self.first_error is None:
                self.first_error = verdict.error or graded.failure
            out.append(graded)
        return out

    def __call__(self, completion: str, item: Item) -> float:
        """One sample (a sub-grader of ``multi``); a failure raises, as a grader's does."""
        graded = self.grade_batch([completion], [item])[0]
        if graded.failure is not None:
            raise RuntimeError(self.first_error or graded.failure)
        return graded.score

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
