"""OpenAI's ``score_model`` grader: a judge model scores each sample."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field, field_validator

from grading.endpoints import ENDPOINT_NAME_PATTERN, JudgeSettings, build_judge_settings
from grading.graders.base import Graded, GraderSpecBase, Item
from grading.judge import chat_all, request_body
from grading.templates import (
    MAX_TEMPLATE_CHARS,
    TemplateError,
    check_template_field,
    render,
    sample_namespace,
)
from specbase import StrictModel

__all__ = [
    "JudgeMessage",
    "JudgeSamplingParams",
    "JudgeScore",
    "ScoreModelGrader",
    "parse_score",
]

_ScaleEnd = Annotated[float, Field(ge=-1e6, le=1e6)]


class JudgeMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="Who speaks.")
    type: Literal["message"] | None = Field(
        default=None, description="OpenAI's item type; accepted, always a message."
    )
    content: str = Field(
        max_length=MAX_TEMPLATE_CHARS, description="A template over sample and item."
    )

    _template = field_validator("content")(check_template_field)


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
        pattern=ENDPOINT_NAME_PATTERN,
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

    def build(self, name: str) -> JudgeScore:
        return JudgeScore(name, self.weight, self)


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
