"""/v1/models: the models this project may name (OpenAI's list and retrieve, so the `openai`
SDK's `models.list()` and `models.retrieve()` work unchanged). Errors are OpenAI's: 400 for a
malformed name, 404 `model_not_found` (param `model`) for any name the project cannot use.
Listing a model says nothing of serving it yet: chat and completions come with the inference
tier (issue 26)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from app.core.deps import SessionDep
from app.core.responses import OPENAI_ERRORS
from app.inference import service as models
from app.inference.schemas import MAX_MODEL_NAME, ModelList, ModelOut
from app.sessions.deps import PrincipalDep

router = APIRouter(prefix="/v1/models", tags=["models (OpenAI)"], responses=OPENAI_ERRORS)

# `:path`: a name may hold '/' (a Hub repo id inside an `ft:` name), which the SDK sends as %2F.
ModelName = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_MODEL_NAME,
        description="A base model, an ft: name (ft:...:<job id>[:ckpt-step-N]) or a job id "
        "(job_...[@N]).",
    ),
]


@router.get(
    "",
    response_model=ModelList,
    summary="The base models and this project's fine-tuned models and checkpoints",
    description="The packaged base models (first page only), then the project's jobs holding "
    f"kept checkpoints, newest first, `limit` jobs a page: each job's `ft:` name once it "
    f"succeeded, then its newest {models.CHECKPOINTS_PER_JOB} checkpoints. Older checkpoints "
    "still resolve by name.",
)
def list_models(
    principal: PrincipalDep,
    session: SessionDep,
    after: Annotated[str | None, Query(max_length=64, description="The last job id seen.")] = None,
    limit: Annotated[int, Query(ge=1, le=100, description="Jobs per page.")] = 20,
) -> ModelList:
    page = models.catalogue(session, project_id=principal.project_id, after=after, limit=limit)
    return ModelList(
        data=[models.model_object(m) for m in page.models],
        has_more=page.has_more,
        next_after=page.next_after,
    )


@router.get("/{model:path}", response_model=ModelOut, summary="Retrieve a model by name")
def retrieve_model(model: ModelName, principal: PrincipalDep, session: SessionDep) -> ModelOut:
    resolved = models.resolve_model(session, project_id=principal.project_id, name=model)
    return models.model_object(resolved)
