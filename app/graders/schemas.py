"""Response bodies of /v1/graders."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class GraderRunErrors(BaseModel):
    failure: Literal["error", "timeout"] | None = Field(
        default=None, description="Why the grade failed (it then scores 0), or null."
    )
    message: str | None = Field(default=None, description="The grader's own error, if any.")


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderRunErrors
    execution_time: float = Field(description="Seconds the grade took.")
    scores: dict[str, float] = Field(description="The grader's score, and its sub-graders'.")


class GraderRunOut(BaseModel):
    reward: float = Field(description="The score in [0, 1] (0 when the grade failed).")
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float] = Field(description="A multi grader's sub-grader scores.")


class GraderValidateOut(BaseModel):
    grader: dict[str, Any] = Field(description="The grader with every default filled in.")
