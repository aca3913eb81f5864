"""OpenAI's ``score_model`` grader: a judge model scores each sample."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from grading.graders.base import Graded, Item
from grading.judge import JudgeSettings, build_judge_settings, chat_all, request_body
from jobspec.graders import ScoreModelGrader
from jobspec.templates import TemplateError, render, sample_namespace

__all__ = ["JudgeScore", "parse_score"]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_score(reply: str) -> float | None:
    """The judge's score: ``{"score": x}`` when the reply is that JSON, else the last number
    in it; None when there is none."""
    text = reply.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("score"), int | float):
            return float(data["score"])
    numbers = _NUMBER.findall(text[-10_000:])
    return float(numbers[-1]) if numbers else None


@dataclass
class JudgeScore:
    """A BatchGrader: one judge call per sample, concurrently (``grading.judge``); a reply
    without a score in ``range``, an unreachable judge or a timeout scores 0 and is counted."""

    name: str
    weight: float
    spec: ScoreModelGrader
    settings: JudgeSettings = field(default_factory=build_judge_settings)
    first_error: str | None = None

    @classmethod
    def from_spec(cls, spec: ScoreModelGrader, name: str) -> JudgeScore:
        return cls(name, spec.weight, spec)

    def grade_batch(self, completions: Sequence[object], items: Sequence[Item]) -> list[Graded]:
        if len(completions) != len(items):
            raise ValueError(f"{len(completions)} completions but {len(items)} items")
        self.first_error = None
        endpoint = self.settings.endpoints.get(self.spec.endpoint)
        if endpoint is None:
            self.first_error = (
                f"judge endpoint {self.spec.endpoint!r} is not configured on this worker "
                "(GRPO_JUDGE_ENDPOINTS)"
            )
            return [Graded(0.0, "error") for _ in completions]
        out: list[Graded | None] = [None] * len(completions)
        bodies, where = [], []
        params = self.spec.sampling_params.model_dump()
        for i, (completion, item) in enumerate(zip(completions, items, strict=True)):
            if not isinstance(completion, str):
                out[i] = Graded(0.0, "error")
                continue
            sample = sample_namespace(completion)
            try:
                messages = [
                    {"role": m.role, "content": render(m.content, sample=sample, item=item)}
                    for m in self.spec.input
                ]
            except TemplateError as exc:
                out[i] = self._fail("error", str(exc))
                continue
            bodies.append(request_body(endpoint.model or self.spec.model, messages, params))
            where.append(i)
        low, high = self.spec.range
        for i, reply in zip(where, chat_all(endpoint, bodies, self.settings), strict=True):
            if reply.text is None:
                out[i] = self._fail(reply.failure or "error", reply.reason or "no reply")
                continue
            score = parse_score(reply.text)
            if score is None or not low <= score <= high:
                out[i] = self._fail(
                    "error",
                    f"no score in [{low:g}, {high:g}] in the judge's reply {reply.text[:80]!r}",
                )
                continue
            out[i] = Graded((score - low) / (high - low))
        return [g if g is not None else Graded(0.0, "error") for g in out]

    def _fail(self, failure: str, reason: str) -> Graded:
        if self.first_error is None:
            self.first_error = reason
        return Graded(0.0, "timeout" if failure == "timeout" else "error")

    def __call__(self, completion: str, item: Item) -> float:
        """One sample (a sub-grader of ``multi``); a failure raises, as a grader's does."""
        graded = self.grade_batch([completion], [item])[0]
        if graded.failure is not None:
            raise RuntimeError(self.first_error or graded.failure)
        return graded.score
