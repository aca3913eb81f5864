"""The Tinker API's sampling calls (``/api/v1``): sampling sessions over a training client's
saved weights or over a base model alone, and ``asample`` (which ``compute_logprobs`` sends
too), applied by the worker that holds the weights' model (worker/tinker_model.py). Thin, as
app.tinker.routes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.core.deps import SessionDep, StateDep
from app.core.errors import InvalidRequest
from app.tinker import admission, catalog, samplers, service
from app.tinker import schemas as s
from app.tinker.deps import JsonBody, TinkerPrincipalDep
from app.tinker.routes import future_answer, parse_json, path_parts, wire_refusal
from app.tinker.wire import WireError

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)

# Sample options the SDK may send that this server does not compute: refused at once (a 400
# naming the option), not failed later by the worker.
UNSERVED_SAMPLE_OPTIONS = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "prompt_alt_tokens_k",
    "target_prompt_logprobs",
    "prompt_logprobs_last_n",
    "record_stability_info",
)


@router.post("/create_sampling_session")
def create_sampling_session(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.CreateSamplingSessionRequest)
    if body.model_path is None:
        assert body.base_model is not None  # the schema asks for one of the two
        sampler_id = samplers.add_base_sampler(
            db,
            state.settings,
            principal.project_id,
            session_id=body.session_id,
            sampling_seq_id=body.sampling_session_seq_id,
            base_model=body.base_model,
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}
    model_id, kind, name = path_parts(body.model_path)
    if (
        kind != "sampler_weights"
        or catalog.repo.get_checkpoint(
            db, project_id=principal.project_id, model_id=model_id, kind=kind, name=name
        )
        is None
    ):
        raise service.TinkerBadRequest(f"no sampler weights {body.model_path[:300]}")
    sampler_id = samplers.add_sampler(
        db,
        state.settings,
        principal.project_id,
        session_id=body.session_id,
        sampling_seq_id=body.sampling_session_seq_id,
        model_id=model_id,
        model_path=body.model_path,
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, principal: TinkerPrincipalDep, db: SessionDep) -> dict[str, Any]:
    return catalog.sampler_info(db, principal.project_id, sampler_id)


@router.post("/asample")
def asample(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    settings = state.settings
    body = parse_json(raw, s.SampleRequest)
    if body.sampling_session_id is None or body.seq_id is None:
        raise InvalidRequest("sampling_session_id and seq_id are required")
    unserved = [name for name in UNSERVED_SAMPLE_OPTIONS if getattr(body, name)]
    if unserved:
        raise service.TinkerBadRequest(
            f"{unserved[0]}: not served here (tokens, their log-probabilities and prompt "
            "log-probabilities are)",
            param=unserved[0],
        )
    if body.num_samples > settings.tinker_max_samples_per_call:
        raise InvalidRequest(
            f"num_samples: at most {settings.tinker_max_samples_per_call} per call",
            param="num_samples",
        )
    max_tokens = body.sampling_params.max_tokens
    if max_tokens is not None and max_tokens > settings.tinker_max_sample_tokens:
        raise InvalidRequest(
            f"sampling_params.max_tokens: at most {settings.tinker_max_sample_tokens}",
            param="sampling_params.max_tokens",
        )
    try:
        prompt = body.prompt_tokens()
    except WireError as exc:
        raise wire_refusal(exc) from None
    # Checked against the model and the server's budget before the body is stored.
    model = samplers.sampler_model(db, settings, principal.project_id, body.sampling_session_id)
    admission.check_sample(
        prompt,
        body.num_samples,
        admission.sample_max_tokens(max_tokens, settings),
        settings,
        admission.model_limits(model),
    )
    accepted = samplers.submit_sample(
        db,
        settings,
        sampler_id=body.sampling_session_id,
        model=model,
        seq_id=body.seq_id,
        num_samples=body.num_samples,
        body=raw,
    )
    return future_answer(accepted)
