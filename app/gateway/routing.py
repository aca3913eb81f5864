"""Which inference process serves a request, and making its weights ready there.

1. `plan`: the model name resolves for the project (app.gateway.service.resolve_model, 404
   `model_not_found` otherwise) into the
   :class:`~app.gateway.protocol.EnsureRequest` an inference process needs: the base model
   alone; a full fine-tune's checkpoint (`full`); or LoRA adapters (`adapter`) over the base
   model, or over the full checkpoint the LoRA job started from (`base_weights`, looked up in
   the project's kept checkpoints); and the
   :class:`~app.gateway.engine_identity.EngineOptions` the engine runs them with: the base
   model at the job's `model_revision`, in the job's rollout dtype;
2. the fresh registered processes serving that base (`bases` holding it, or "*") are ordered:
   first those whose state shows the weights warm (the adapter loaded, the full checkpoint's
   engine up; then, for an adapter, its engine up), then the least loaded (running requests);
   none: 503 `no_inference_server` with Retry-After;
3. `ensure_ready` asks them in that order, `POST {control_url}/engines/ensure` (naming the
   request's project, whose share of an engine's adapter slots LoRA adapters count against):
   the first answer wins; a 503 Busy is passed to the client (503 with the process's
   Retry-After, which the openai SDK honours) unless the process is draining, and so is a 429
   Busy (`adapter_share`: the project holds its share of the engine's adapter slots and uses
   every one; 429 with Retry-After, which the SDK honours too); a process that cannot be
   reached or fails is skipped; when none is left, 422 `model_not_servable` (400 on these
   OpenAI paths) with the reason if one said it can never serve the weights (a LoRA rank past
   its GRPO_INFERENCE_MAX_LORA_RANK, an engine larger than its memory budget), else 503
   `inference_unavailable`. No message names an inference host or process;
4. `release` gives the ensure's hold on LoRA adapters back when the request ends (the stream
   calls it however the request ends): the adapter stays loaded for the requests using it,
   not for a while after them. A release that fails is only logged: the hold lapses by itself.

A process's state names its engines and adapters as app.gateway.served_kinds says (the
process reads the same module); the gateway compares those names for equality, in the dtype
the process runs its engines in (its operator's, ServerState.dtype, or the job's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.core.errors import (
    ApiError,
    InferenceUnavailable,
    InvalidRequest,
    ModelNotFound,
    TooManyRequests,
)
from app.core.models import InferenceServer
from app.gateway import servers_repository as servers_repo
from app.gateway import service as models
from app.gateway.chat_as_trained import TrainedPrompt
from app.gateway.engine_identity import EngineOptions, engine_dtype
from app.gateway.protocol import (
    ANY_BASE,
    ENSURE_PATH,
    RELEASE_PATH,
    TOKEN_HEADER,
    Busy,
    EnsureRequest,
    EnsureResponse,
    HoldRelease,
    ServerState,
    WeightsRef,
)
from app.gateway.served_kinds import BASE, FULL, engine_name, kind_of, served_name
from app.jobs import checkpoints_repository as checkpoints_repo
from jobspec.checkpoint_files import folder_name

log = logging.getLogger(__name__)

# Warmth ranks, best first.
WEIGHTS_WARM = 2  # the adapter is loaded, or the engine of these exact weights is up
ENGINE_WARM = 1  # an adapter's engine is up (loading the adapter takes a moment)
COLD = 0
RELEASE_TIMEOUT_S = 5.0  # giving an adapter hold back (an instant on the process)


class AdapterShareExceeded(TooManyRequests):
    """The project already holds its share of the engine's adapter slots
    (GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT) and its requests use every one: 429 with the
    process's Retry-After, until one of them ends."""

    code = "adapter_share"


class ModelNotServable(InvalidRequest):
    """The inference processes serving the model's base say they can never serve these
    weights: a final refusal with their reason, not a 503 a retry would repeat forever."""

    code = "model_not_servable"


@dataclass(frozen=True)
class Candidate:
    server_id: str
    control_url: str
    warmth: int
    load: int  # requests its engines run now


@dataclass(frozen=True)
class Plan:
    model: str  # the name the client gave, shown back in every answer
    ensure: EnsureRequest
    options: EngineOptions
    candidates: list[Candidate]
    # A fine-tuned model's prompt settings, which a chat request is written with
    # (app.gateway.chat_as_trained); None for a base model.
    prompt: TrainedPrompt | None = None
    # The project asking: its LoRA adapters count against its share of an engine's slots.
    project_id: str | None = None


@dataclass(frozen=True)
class Ready:
    """An ensure's answer, and the process that gave it (where its hold is released)."""

    target: EnsureResponse
    control_url: str


def engine_options(model: models.ResolvedModel) -> EngineOptions:
    """How the engine must run `model`'s weights: as the job's rollouts ran them (a bare base
    model as a job's first rollouts would)."""
    return EngineOptions(revision=model.revision, dtype=model.dtype)


def ensure_request(
    session: Session, *, project_id: str, model: models.ResolvedModel
) -> EnsureRequest:
    """What an inference process must load to serve `model`."""
    if model.kind == BASE.name:
        return EnsureRequest(base_model=model.base_model)
    if model.sampler is not None:  # a Tinker sampler save: adapters over the base model
        return EnsureRequest(base_model=model.base_model, adapter=model.sampler)
    assert model.job_id is not None and model.checkpoint_folder is not None
    weights = WeightsRef(job_id=model.job_id, folder=model.checkpoint_folder)
    if model.kind == FULL.name:
        return EnsureRequest(base_model=model.base_model, full=weights)
    base_weights = None
    if model.base_checkpoint is not None:
        job_id, step = model.base_checkpoint
        kept = checkpoints_repo.checkpoint_of_project_job(
            session, project_id=project_id, job_id=job_id, step=int(step or 0)
        )
        if kept is None:
            raise ModelNotFound(
                f"The model {model.name[:200]!r} is LoRA adapters over the checkpoint of step "
                f"{step} of job {job_id}, which is no longer kept: it cannot be served.",
                param="model",
            )
        base_weights = WeightsRef(job_id=job_id, folder=folder_name(kept.path))
    return EnsureRequest(base_model=model.base_model, adapter=weights, base_weights=base_weights)


def _state(server: InferenceServer) -> ServerState | None:
    try:
        return ServerState.model_validate(server.state or {})
    except ValidationError:
        log.warning("inference server %s has a state the gateway cannot read", server.id)
        return None


def warmth(
    state: ServerState | None, ensure: EnsureRequest, options: EngineOptions | None = None
) -> int:
    """How ready `state`'s process is to serve the weights: the engine they run in is up
    (named exactly, in the dtype that process runs it in), and their adapters in it."""
    if state is None:
        return COLD
    options = options or EngineOptions()
    dtype = engine_dtype(options.dtype, state.dtype)
    key = engine_name(ensure, revision=options.revision, dtype=dtype)
    on_base_engine = kind_of(ensure).on_base_engine
    adapter = served_name(ensure.adapter) if ensure.adapter is not None else None
    best = COLD
    for engine in state.engines:
        if engine.status != "ready" or engine.key != key:
            continue
        if not on_base_engine or adapter in engine.adapters:
            return WEIGHTS_WARM
        best = ENGINE_WARM
    return best


def choose(
    servers: Sequence[InferenceServer],
    ensure: EnsureRequest,
    options: EngineOptions | None = None,
) -> list[Candidate]:
    """The servers serving `ensure`'s base, in the order to ask them: warmest, then least
    loaded, then the registry's order (oldest start first)."""
    found = []
    for server in servers:
        bases = [str(b) for b in (server.bases or [])]
        if ANY_BASE not in bases and ensure.base_model not in bases:
            continue
        state = _state(server)
        load = sum(e.running_requests for e in state.engines) if state else 0
        found.append(Candidate(server.id, server.control_url, warmth(state, ensure, options), load))
    indexed = sorted(enumerate(found), key=lambda p: (-p[1].warmth, p[1].load, p[0]))
    return [candidate for _, candidate in indexed]


def plan(session: Session, *, project_id: str, name: str, no_server_retry_after: int) -> Plan:
    """Resolve `name` and find the servers for it (404 `model_not_found`, 503
    `no_inference_server`)."""
    model = models.resolve_model(session, project_id=project_id, name=name)
    ensure = ensure_request(session, project_id=project_id, model=model)
    options = engine_options(model)
    candidates = choose(servers_repo.fresh_servers(session), ensure, options)
    if not candidates:
        raise InferenceUnavailable(
            f"no inference process serves the base model {ensure.base_model[:200]!r} now "
            "(none registered, or none has sent a heartbeat lately); retry later",
            retry_after=no_server_retry_after,
            code="no_inference_server",
        )
    return Plan(
        model=name,
        ensure=ensure,
        options=options,
        candidates=candidates,
        prompt=model.prompt,
        project_id=project_id,
    )


def auth_headers(token: str | None) -> dict[str, str]:
    """What the vLLM servers want when the operator set a token (the inference process starts
    them with it as their API key)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def control_headers(token: str | None) -> dict[str, str]:
    """What an inference process's control API wants when the operator set a token."""
    return {TOKEN_HEADER: token} if token else {}


def _busy(response: httpx.Response) -> Busy | None:
    try:
        return Busy.model_validate_json(response.content)
    except ValidationError:
        return None


def _retry_after(response: httpx.Response, busy: Busy | None, default: int) -> int:
    header = response.headers.get("Retry-After", "")
    if header.strip().isdigit():
        return max(1, int(header))
    return max(1, busy.retry_after_s) if busy is not None else default


def _refusal(response: httpx.Response) -> str | None:
    """The reason of a process's 422 (weights it can never serve), or None for any other
    answer."""
    if response.status_code != 422:
        return None
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail)[:500] if detail else "the inference tier cannot serve these weights"


def _busy_error(response: httpx.Response, busy: Busy | None, default_retry: int) -> ApiError:
    """A process's Busy answer as the client's: 429 `adapter_share` for its project's share of
    adapter slots, else 503 with the reason as code; the process's Retry-After either way."""
    retry_after = _retry_after(response, busy, default_retry)
    reason = busy.reason if busy is not None else "busy"
    detail = busy.detail[:500] if busy is not None else "the inference process is busy"
    if response.status_code == 429:
        return AdapterShareExceeded(f"{detail}; retry after the wait", retry_after=retry_after)
    return InferenceUnavailable(
        f"the model is not ready yet ({reason}): {detail}; retry after the wait",
        retry_after=retry_after,
        code=reason,
    )


async def ensure_ready(
    client: httpx.AsyncClient, plan: Plan, *, token: str | None, timeout_s: float, retry_after: int
) -> Ready:
    """Ask the candidates in order until one has the weights ready (see the module doc). The
    processes are named in this log only, never to the client."""
    payload = {
        **plan.ensure.model_dump(mode="json"),
        **plan.options.model_dump(mode="json"),
        "project_id": plan.project_id,
    }
    failures: list[str] = []
    refusal: str | None = None
    for candidate in plan.candidates:
        url = candidate.control_url.rstrip("/") + ENSURE_PATH
        try:
            response = await client.post(
                url, json=payload, headers=control_headers(token), timeout=timeout_s
            )
        except httpx.HTTPError as exc:
            log.warning("inference server %s unreachable: %r", candidate.server_id, exc)
            failures.append("unreachable")
            continue
        if response.status_code == 200:
            try:
                target = EnsureResponse.model_validate_json(response.content)
            except ValidationError:
                failures.append("an unreadable answer")
                continue
            return Ready(target, candidate.control_url)
        if response.status_code in (429, 503):
            busy = _busy(response)
            if busy is None or busy.reason != "draining":
                raise _busy_error(response, busy, retry_after)
        log.warning(
            "inference server %s answered ensure with %s: %s",
            candidate.server_id,
            response.status_code,
            response.text[:500],
        )
        refusal = refusal or _refusal(response)
        failures.append(str(response.status_code))
    if refusal is not None:  # no process can, and one said it never will: final
        raise ModelNotServable(
            f"The model {plan.model[:200]!r} cannot be served: {refusal}", param="model"
        )
    raise InferenceUnavailable(
        f"no inference process could make the model ready ({', '.join(failures)[:300]}); "
        "retry later",
        retry_after=retry_after,
        code="inference_unavailable",
    )


async def release(client: httpx.AsyncClient, ready: Ready, *, token: str | None) -> None:
    """Give back the ensure's hold on LoRA adapters (none: nothing to do). Never raises: the
    answer is given by now, and a hold the process does not hear of lapses by itself."""
    hold = ready.target.hold
    if hold is None:
        return
    url = ready.control_url.rstrip("/") + RELEASE_PATH
    try:
        response = await client.post(
            url,
            json=HoldRelease(hold=hold).model_dump(),
            headers=control_headers(token),
            timeout=RELEASE_TIMEOUT_S,
        )
    except httpx.HTTPError as exc:
        log.warning("releasing an adapter hold at %s failed: %r", ready.control_url, exc)
        return
    if response.status_code != 200:
        log.warning(
            "releasing an adapter hold at %s: %s %s",
            ready.control_url,
            response.status_code,
            response.text[:200],
        )
