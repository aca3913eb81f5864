"""/v1/graders: try a grader on a sample before a job spends a GPU on it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, field_validator

from app.core.deps import StateDep
from app.core.responses import ERRORS, ErrorResponse
from app.graders import service as graders_service
from app.graders.schemas import GraderRunErrors, GraderRunMetadata, GraderRunOut, GraderValidateOut
from app.sessions.deps import PrincipalDep
from jobspec import MAX_TEXT_CHARS, GraderSpec, row_fields_problem, text_problem

router = APIRouter(prefix="/v1/graders", tags=["graders"], responses=ERRORS)


class GraderRunIn(BaseModel):
    grader: GraderSpec = Field(description="A grader, as in a job spec's graders list.")
    model_sample: Annotated[str, Field(max_length=5 * MAX_TEXT_CHARS)] = Field(
        description="The completion to grade (sample.output_text)."
    )
    item: dict[str, Any] = Field(
        default_factory=dict, description="The dataset row the grader reads as item."
    )

    @field_validator("model_sample")
    @classmethod
    def _storable(cls, value: str) -> str:
        problem = text_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("item")
    @classmethod
    def _bounded_row(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = row_fields_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class GraderValidateIn(BaseModel):
    grader: GraderSpec


@router.post(
    "/run",
    response_model=GraderRunOut,
    summary="Run a grader on one sample",
    responses={
        429: {
            "model": ErrorResponse,
            "description": "The project's python graders hold its share of this server's "
            "sandboxes (GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT); see Retry-After.",
        },
        503: {
            "model": ErrorResponse,
            "description": "Database unavailable, or every python-grader sandbox of this "
            "server is busy (GRPO_SANDBOX_MAX_SANDBOXES); see Retry-After.",
        },
    },
)
def run_grader(body: GraderRunIn, principal: PrincipalDep, state: StateDep) -> GraderRunOut:
    result = graders_service.run_grader(
        body.grader,
        body.model_sample,
        body.item,
        sandboxes=state.sandboxes,
        project_id=principal.project_id,
    )
    return GraderRunOut(
        reward=result.reward,
        metadata=GraderRunMetadata(
            name=result.name,
            type=result.type,
            errors=GraderRunErrors(failure=result.failure, message=result.message),  # type: ignore[arg-type]
            execution_time=result.execution_time,
            scores=result.scores,
        ),
        sub_rewards=result.sub_rewards,
    )


@router.post(
    "/validate", response_model=GraderValidateOut, summary="Check a grader without running it"
)
def validate_grader(body: GraderValidateIn, principal: PrincipalDep) -> GraderValidateOut:
    graders_service.validate_grader(body.grader)
    return GraderValidateOut(grader=body.grader.model_dump(mode="json"))
