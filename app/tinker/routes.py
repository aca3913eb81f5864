"""The Tinker API (``/api/v1/...``), the paths the official ``tinker`` SDK calls (docs/tinker.md).
Thin: a body parsed and bounded, the rule in app.tinker.service, catalog or futures.

Calls that return a future (create_model, forward_backward, forward, optim_step, save_weights,
save_weights_for_sampler, load_weights, asample) answer at once with a ``request_id``; the
model's worker applies them (worker/tinker_model.py) and ``retrieve_future`` returns the result.

Every route that uses the database is a plain function (the threadpool runs it), its body read
before by an async dependency (app.tinker.deps); only retrieve_future is async, and it reads the
database in threads of its own.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Response
from pydantic import BaseModel, ValidationError

from app.core.deps import SessionDep, StateDep
from app.core.errors import InvalidRequest
from app.tinker import admission, catalog, samplers, service
from app.tinker import schemas as s
from app.tinker.deps import ForwardBackwardBody, JsonBody, TinkerPrincipalDep
from app.tinker.futures import await_outcome
from app.tinker.schema_parts import REFUSED_ERROR_TYPES
from app.tinker.states import RequestKind
from app.tinker.wire import WireError, decode_forward_backward, fwdbwd_chunk_bytes

router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)

M = TypeVar("M", bound=BaseModel)


def parse_json(body: bytes, model: type[M]) -> M:
    """The JSON body as ``model``: a 422 naming the field where it does not fit the schema,
    a 400 where the schema refuses a value it read (a number that is not finite, a degenerate
    sampling parameter: ``schema_parts.REFUSED_ERROR_TYPES``)."""
    if b"\\u0000" in body:  # Postgres stores no NUL in text
        raise InvalidRequest("the body holds a NUL character")
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        refused = first["type"] in REFUSED_ERROR_TYPES
        error = service.TinkerBadRequest if refused else InvalidRequest
        raise error(f"{where}: {first['msg']}", param=where) from None


def wire_refusal(exc: WireError) -> service.TinkerBadRequest:
    """The 400 of a body the wire or prompt decoding refused: their messages start with the
    field (``data[2].model_input: ...``, ``prompt.chunks[1]: ...``), which ``param`` names."""
    return service.TinkerBadRequest(str(exc), param=str(exc).partition(": ")[0])


def path_parts(path: str) -> tuple[str, str, str]:
    """A ``tinker://<model>/<kind>/<name>`` path's parts (400 naming the path otherwise)."""
    try:
        return s.parse_tinker_path(path)
    except WireError as exc:
        raise service.TinkerBadRequest(str(exc), param="path") from None


def future_answer(accepted: service.Accepted) -> dict[str, Any]:
    answer: dict[str, Any] = {"request_id": accepted.request_id, "model_id": accepted.model_id}
    if accepted.sample_sequence_ids is not None:
        answer["sample_sequence_ids"] = accepted.sample_sequence_ids
    return answer


# ------------------------------------------------------------------ client and session


@router.post("/client/config")
async def client_config(state: StateDep) -> dict[str, Any]:
    settings = state.settings
    # The SDK's estimate of a chunk's bytes leaves out the framing: ask for chunks that fit.
    chunk_bytes = fwdbwd_chunk_bytes(
        settings.tinker_max_body_bytes,
        settings.tinker_max_tokens_per_call,
        settings.tinker_max_chunk_datums,
    )
    return s.client_config(settings.tinker_max_chunk_datums, chunk_bytes)


@router.post("/client/dynamic_config")
async def dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(_principal: TinkerPrincipalDep, state: StateDep) -> dict[str, Any]:
    return catalog.capabilities(state.settings)


@router.post("/create_session")
def create_session(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.CreateSessionRequest)
    session_id = service.create_session(
        db,
        state.settings,
        principal.project_id,
        display_name=body.display_name,
        tags=list(body.tags),
        user_metadata=dict(body.user_metadata or {}),
        sdk_version=body.sdk_version,
    )
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
def session_heartbeat(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.SessionHeartbeatRequest)
    service.heartbeat(db, state.settings, principal.project_id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
def telemetry(_principal: TinkerPrincipalDep, _body: JsonBody) -> dict[str, str]:
    return {"status": "accepted"}  # read and dropped: we keep no client telemetry


@router.post("/sessions/{session_id}/finish")
def finish_session(
    session_id: str, principal: TinkerPrincipalDep, raw: JsonBody, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.SessionFinishRequest)
    reason = body.reason.type if body.reason is not None else None
    service.finish_session(db, principal.project_id, session_id, reason)
    return {}


# ------------------------------------------------------------------ training


@router.post("/create_model")
def create_model(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.CreateModelRequest)
    if body.lora_config is None:
        raise InvalidRequest("lora_config is required: this server trains LoRA adapters")
    if body.optimizer_config.type != "adamw":
        raise InvalidRequest("optimizer_config.type: only adamw is served here")
    lora = body.lora_config.model_dump(exclude={"rank"})
    accepted = service.create_model(
        db,
        state.settings,
        principal.project_id,
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        base_model=body.base_model,
        lora_rank=body.lora_config.rank,
        lora=lora,
        body=raw,
    )
    return future_answer(accepted)


@router.post("/get_info")
def get_info(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.GetInfoRequest)
    return catalog.model_info(db, state.settings, principal.project_id, body.model_id)


@router.post("/forward_backward")
def forward_backward(
    principal: TinkerPrincipalDep, raw: ForwardBackwardBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    settings = state.settings
    try:
        call = decode_forward_backward(
            raw,
            max_bytes=settings.tinker_max_body_bytes,
            max_datums=settings.tinker_max_chunk_datums,
            max_tokens=settings.tinker_max_tokens_per_call,
        )
    except WireError as exc:
        raise wire_refusal(exc) from None
    # Checked against the loss and the model before the body is stored.
    model = service.usable_model(db, settings, principal.project_id, call.model_id)
    admission.check_forward_backward(call, admission.model_limits(model))
    accepted = service.submit(
        db,
        settings,
        principal.project_id,
        model_id=call.model_id,
        seq_id=call.seq_id,
        kind="forward" if call.forward_only else "forward_backward",
        body=raw,
    )
    return future_answer(accepted)


def _training_call(
    raw: bytes,
    principal: TinkerPrincipalDep,
    state: StateDep,
    db: SessionDep,
    model: type[s.OptimStepRequest] | type[s.SaveWeightsRequest],
    kind: RequestKind,
) -> dict[str, Any]:
    body = parse_json(raw, model)
    if body.seq_id is None:
        raise InvalidRequest("seq_id is required", param="seq_id")
    accepted = service.submit(
        db,
        state.settings,
        principal.project_id,
        model_id=body.model_id,
        seq_id=body.seq_id,
        kind=kind,
        body=raw,
    )
    return future_answer(accepted)


@router.post("/optim_step")
def optim_step(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    return _training_call(raw, principal, state, db, s.OptimStepRequest, "optim_step")


@router.post("/save_weights")
def save_weights(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    return _training_call(raw, principal, state, db, s.SaveWeightsRequest, "save_weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.SaveWeightsForSamplerRequest)
    if body.seq_id is None:
        raise InvalidRequest("seq_id is required", param="seq_id")
    if body.sampling_session_seq_id is not None:  # a new sampling session over these weights
        try:
            session_id, _ = s.parse_training_model_id(body.model_id)
        except WireError as exc:
            raise service.TinkerBadRequest(str(exc), param="model_id") from None
        samplers.add_sampler(
            db,
            state.settings,
            principal.project_id,
            session_id=session_id,
            sampling_seq_id=body.sampling_session_seq_id,
            model_id=body.model_id,
            model_path=None,
        )
    accepted = service.submit(
        db,
        state.settings,
        principal.project_id,
        model_id=body.model_id,
        seq_id=body.seq_id,
        kind="save_weights_for_sampler",
        body=raw,
    )
    return future_answer(accepted)


@router.post("/load_weights")
def load_weights(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep, db: SessionDep
) -> dict[str, Any]:
    body = parse_json(raw, s.LoadWeightsRequest)
    if not body.creates_model or body.session_id is None or body.model_seq_id is None:
        raise InvalidRequest(
            "load_weights into a running client is not served: restore with "
            "create_training_client_from_state(path)"
        )
    source, kind, name = path_parts(body.path)
    if kind != "weights":
        raise InvalidRequest("path: a training state is a tinker://<model>/weights/<name> path")
    accepted = service.load_model(
        db,
        state.settings,
        principal.project_id,
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        source_model_id=source,
        name=name,
        optimizer=body.optimizer,
        body=raw,
    )
    return future_answer(accepted)


# ------------------------------------------------------------------ futures and saves


@router.post("/retrieve_future")
async def retrieve_future(
    principal: TinkerPrincipalDep, raw: JsonBody, state: StateDep
) -> Response:
    body = parse_json(raw, s.RetrieveFutureRequest)
    outcome = await await_outcome(
        state.sessions, state.settings, principal.project_id, body.request_id
    )
    if outcome.payload is None:
        waiting = s.TryAgainResponse(
            request_id=body.request_id,
            queue_state="paused_capacity" if outcome.waiting else "active",
            queue_state_reason=outcome.waiting,
        )
        return Response(waiting.model_dump_json(exclude_none=True), media_type="application/json")
    return Response(outcome.payload, media_type=outcome.media)


@router.get("/training_runs/{model_id}/checkpoints")
def list_checkpoints(
    model_id: str, principal: TinkerPrincipalDep, db: SessionDep
) -> dict[str, Any]:
    return catalog.checkpoints(db, principal.project_id, model_id)


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(
    model_id: str, checkpoint_id: str, principal: TinkerPrincipalDep, db: SessionDep
) -> Response:
    """``RestClient.delete_checkpoint``: the save (``weights/<name>`` or
    ``sampler_weights/<name>``) is gone at once for every call; a worker removes its folder."""
    catalog.delete_checkpoint(db, principal.project_id, model_id, checkpoint_id)
    return Response(status_code=204)


@router.post("/weights_info")
def weights_info(principal: TinkerPrincipalDep, raw: JsonBody, db: SessionDep) -> dict[str, Any]:
    body = parse_json(raw, s.WeightsInfoRequest)
    model_id, kind, name = path_parts(body.tinker_path)
    return catalog.weights_info(db, principal.project_id, model_id, kind, name)
