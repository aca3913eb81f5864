"""/v1/models: the models this project may name (OpenAI's list and retrieve, so the `openai`
SDK's `models.list()` and `models.retrieve()` work unchanged). Errors are OpenAI's: 400 for a
malformed name, 404 `model_not_found` (param `model`) for any name the project cannot use.

/v1/chat/completions and /v1/completions: the gateway to the inference tier (OpenAI's shapes,
so the SDK's `chat.completions.create` and `completions.create` work unchanged, streaming
included). The route checks the request's bounds, resolves the model, finds the inference
processes serving it and checks the project's daily token quota, in its unit of work; the
response (app.gateway.stream) then does the rest with no database session held."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from app.core.clock import utcnow
from app.core.deps import SessionDep, StateDep
from app.core.errors import InvalidRequest
from app.core.responses import INFERENCE_ERRORS, OPENAI_ERRORS
from app.core.state import AppState
from app.gateway import quota, routing
from app.gateway import service as models
from app.gateway.engine_limits import refuse_hazards
from app.gateway.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InferenceRequest,
    check_bounds,
)
from app.gateway.schemas import (
    MAX_MODEL_NAME,
    ModelList,
    ModelOut,
    holds_control_characters,
)
from app.gateway.stream import GatewayResponse
from app.sessions.deps import InferencePrincipalDep, PrincipalDep
from app.sessions.service import Principal

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
def retrieve_model(
    model: ModelName, request: Request, principal: PrincipalDep, session: SessionDep
) -> ModelOut:
    # The route's pattern ends in `$`, which matches before a trailing newline: `name%0A`
    # arrives as `name`. The path as sent must end with the name, and hold no control character.
    sent = str(request.scope.get("path", ""))
    if not sent.endswith(model) or holds_control_characters(sent):
        raise InvalidRequest(
            "a model name holds no control characters (a newline, a tab, ...)", param="model"
        )
    resolved = models.resolve_model(session, project_id=principal.project_id, name=model)
    return models.model_object(resolved)


completions_router = APIRouter(tags=["chat and completions (OpenAI)"], responses=INFERENCE_ERRORS)

_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "OpenAI's chat.completion / text_completion object, or with `stream` "
        "an SSE stream of chunks ending with `data: [DONE]`.",
    }
}


def _gateway(
    body: InferenceRequest, principal: Principal, session: SessionDep, state: AppState
) -> GatewayResponse:
    settings = state.settings
    check_bounds(
        body,
        max_tokens=settings.inference_max_tokens,
        max_choices=settings.inference_max_choices,
        max_prompt_chars=settings.inference_max_prompt_chars,
    )
    refuse_hazards(body)
    plan = routing.plan(
        session,
        project_id=principal.project_id,
        name=body.model,
        no_server_retry_after=settings.inference_no_server_retry_after_s,
    )
    quota.check_daily_tokens(
        session,
        project_id=principal.project_id,
        limit=settings.inference_daily_tokens_per_project,
        now=utcnow(),
    )
    return GatewayResponse(plan=plan, body=body, project_id=principal.project_id, state=state)


@completions_router.post(
    "/v1/chat/completions",
    response_class=Response,
    responses=_ANSWER,
    summary="Chat with a base model, a fine-tuned model or a checkpoint",
)
def create_chat_completion(
    body: ChatCompletionRequest,
    principal: InferencePrincipalDep,
    session: SessionDep,
    state: StateDep,
) -> Response:
    return _gateway(body, principal, session, state)


@completions_router.post(
    "/v1/completions",
    response_class=Response,
    responses=_ANSWER,
    summary="Complete a prompt with a base model, a fine-tuned model or a checkpoint",
)
def create_completion(
    body: CompletionRequest,
    principal: InferencePrincipalDep,
    session: SessionDep,
    state: StateDep,
) -> Response:
    return _gateway(body, principal, session, state)
