"""The JSON bodies of the Tinker API, one request and one reply per call (forward_backward's
body and the sample and forward_backward results are protobuf: ``wire``). Their parts and
bounds are ``schema_parts``; the ids and paths (``names``) are re-exported here.

Requests ignore unknown fields (newer SDKs add some) and bound every string, list and map.
Responses forbid extras and require what the SDK requires (it validates replies strictly). The
SDK sends ``None`` fields not at all and every default explicitly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, model_validator

from app.tinker.names import (  # noqa: F401 (re-exported: the ids and paths)
    parse_tinker_path,
    parse_training_model_id,
    sampler_id,
    tinker_path,
    training_model_id,
)
from app.tinker.schema_parts import (
    AdamParams,
    AnyMetadata,
    Checkpoint,
    CheckpointName,
    Count,
    Cursor,
    FinishReason,
    Id,
    Key,
    LongText,
    LoraConfig,
    ModelData,
    ModelInput,
    OptimizerConfigIn,
    OptimizerConfigOut,
    OptimizerParamsIn,
    PathText,
    SamplingParams,
    SeqId,
    StrMetadata,
    SupportedModel,
    Text,
    TinkerRequest,
    TinkerResponse,
    Ttl,
    json_at_most,
)

# -- client configuration, sessions, telemetry ---------------------------------------------------


class ClientConfigRequest(TinkerRequest):
    """POST /client/config and /client/dynamic_config."""

    sdk_version: Text | None = None


def client_config(max_chunk_datums: int, max_chunk_bytes: int) -> dict[str, Any]:
    """The reply to /client/config, every flag stated (the SDK's defaults differ): the tml- key
    on every request (no JWT exchange), plain httpx (not pyqwest), a model's chunks one at a
    time in seq order (not in parallel with the first chunk last), uncompressed bodies, custom
    losses client-side, and the SDK splitting batches to our limits (``wire.fwdbwd_chunk_bytes``
    gives a ``max_chunk_bytes`` that fits them)."""
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": max_chunk_datums,
        "fwdbwd_max_chunk_bytes_count": max_chunk_bytes,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


class DynamicConfigResponse(TinkerResponse):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: Literal[False] = False  # no /cancel_future
    sample_cancel_max_batch_size: int = 64


class CreateSessionRequest(TinkerRequest):
    tags: list[Annotated[str, Field(max_length=128)]] = Field(default=[], max_length=64)
    user_metadata: AnyMetadata | None = None
    sdk_version: Text | None = None
    project_id: Text | None = None
    display_name: Annotated[str, Field(max_length=200)] | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(TinkerResponse):
    type: Literal["create_session"] = "create_session"
    session_id: Id
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(TinkerRequest):
    session_id: Id
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(TinkerResponse):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class TelemetryRequest(TinkerRequest):
    """The SDK's log and exception events, at most 100 a batch; accepted and dropped."""

    events: list[Annotated[dict[Key, Any], json_at_most(65_536)]] = Field(
        default=[], max_length=100
    )
    platform: Text | None = None
    sdk_version: Text | None = None
    session_id: Text | None = None  # "sessionless-..." for clients without a session
    process_uuid: Text | None = None


class TelemetryResponse(TinkerResponse):
    status: Literal["accepted"] = "accepted"


class SessionFinishRequest(TinkerRequest):
    """POST /sessions/{id}/finish (the SDK ignores the reply: 200 ``{}`` or 204)."""

    reason: FinishReason
    detail: LongText | None = None


class ServerCapabilitiesResponse(TinkerResponse):
    supported_models: list[SupportedModel]


class HealthResponse(TinkerResponse):
    status: Literal["ok"] = "ok"


# -- training models ----------------------------------------------------------------------------


class CreateModelRequest(TinkerRequest):
    session_id: Id
    model_seq_id: Count  # the session's training clients, 0, 1, ... shared with load_weights
    base_model: Annotated[str, Field(min_length=1, max_length=256)]
    user_metadata: AnyMetadata | None = None
    lora_config: LoraConfig | None = None  # the SDK always sends one
    optimizer_config: OptimizerConfigIn = OptimizerConfigIn()
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(TinkerResponse):
    """The result of create_model's future."""

    model_id: Id
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(TinkerRequest):
    model_id: Id
    type: Literal["get_info"] = "get_info"


class GetInfoResponse(TinkerResponse):
    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: Id
    optimizer_config: OptimizerConfigOut = OptimizerConfigOut()
    is_lora: bool
    lora_rank: int | None
    model_name: str


class OptimStepRequest(TinkerRequest):
    model_id: Id
    seq_id: SeqId | None = None
    adam_params: AdamParams | None = Field(
        default=None, validation_alias=AliasChoices("adam_params", "optim_params")
    )
    optimizer_params: OptimizerParamsIn | None = None
    type: Literal["optim_step"] = "optim_step"

    @model_validator(mode="after")
    def _params(self) -> OptimStepRequest:
        if self.adam_params is None and self.optimizer_params is None:
            raise ValueError("adam_params is required")
        return self


class OptimStepResponse(TinkerResponse):
    metrics: dict[str, float] | None  # merged verbatim into the cookbook's logs


class SaveWeightsRequest(TinkerRequest):
    """save_state: weights and optimizer state, as tinker://<model_id>/weights/<path>."""

    model_id: Id
    path: CheckpointName | None = None
    seq_id: SeqId | None = None
    ttl_seconds: Ttl | None = None  # None: kept until deleted
    overwrite: bool = False
    user_metadata: StrMetadata | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsResponse(TinkerResponse):
    path: str
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(TinkerRequest):
    """Either a named sampler checkpoint (``path``), or, with ``sampling_session_seq_id``,
    the weights of a new sampling session (save_weights_and_get_sampling_client)."""

    model_id: Id
    path: CheckpointName | None = None
    sampling_session_seq_id: Count | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: SeqId | None = None
    ttl_seconds: Ttl | None = None
    user_metadata: StrMetadata | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"

    @model_validator(mode="after")
    def _one_mode(self) -> SaveWeightsForSamplerRequest:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("send either path or sampling_session_seq_id")
        return self


class SaveWeightsForSamplerResponse(TinkerResponse):
    """``path`` answers a request with a path, ``sampling_session_id`` one without."""

    path: str | None = None
    sampling_session_id: Id | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"

    @model_validator(mode="after")
    def _answers(self) -> SaveWeightsForSamplerResponse:
        if self.path is None and self.sampling_session_id is None:
            raise ValueError("path or sampling_session_id is required")
        return self


class LoadWeightsRequest(TinkerRequest):
    """Either create-via-load (``session_id`` + ``model_seq_id``: a new model
    ``<session_id>:train:<model_seq_id>``, whose next request is seq 1), or the deprecated
    in-place load (``model_id`` + ``seq_id``)."""

    model_id: Id | None = None
    seq_id: SeqId | None = None
    session_id: Id | None = None
    model_seq_id: Count | None = None
    base_model: Text | None = None
    user_metadata: AnyMetadata | None = None
    path: PathText
    optimizer: bool
    optimizer_config: OptimizerConfigIn | None = None
    weights_access_token: LongText | None = None
    type: Literal["load_weights"] = "load_weights"

    @property
    def creates_model(self) -> bool:
        return self.session_id is not None

    @model_validator(mode="after")
    def _one_mode(self) -> LoadWeightsRequest:
        creates = self.session_id is not None and self.model_seq_id is not None
        in_place = self.model_id is not None and self.seq_id is not None
        if creates == in_place or (creates and self.model_id is not None):
            raise ValueError("send session_id with model_seq_id, or model_id with seq_id")
        return self


class LoadWeightsResponse(TinkerResponse):
    path: str | None
    model_id: str | None
    type: Literal["load_weights"] = "load_weights"


# -- sampling -----------------------------------------------------------------------------------


class CreateSamplingSessionRequest(TinkerRequest):
    session_id: Id
    sampling_session_seq_id: Count  # shared with save_weights_for_sampler's
    base_model: Text | None = None
    model_path: PathText | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"

    @model_validator(mode="after")
    def _source(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("base_model or model_path is required")
        return self


class CreateSamplingSessionResponse(TinkerResponse):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: Id


class GetSamplerResponse(TinkerResponse):
    """GET /samplers/{id}."""

    sampler_id: Id
    base_model: str
    model_path: str | None


class SampleRequest(TinkerRequest):
    """POST /asample (also what compute_logprobs sends: max_tokens 1, prompt_logprobs)."""

    num_samples: int = Field(default=1, ge=1, le=4096)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: Text | None = None
    model_path: PathText | None = None
    sampling_session_id: Id | None = None  # what 0.38 always sends
    seq_id: int | None = Field(default=None, ge=0, lt=2**63)  # a dedupe key only
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=1024)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=1024)
    target_prompt_logprobs: Annotated[dict[Key, Any], json_at_most(1_000_000)] | None = None
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=1024)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"

    def prompt_tokens(self) -> list[int]:
        """The prompt's tokens, or WireError naming the chunk refused."""
        return self.prompt.token_ids("prompt")


# -- futures ------------------------------------------------------------------------------------


class FutureResponse(TinkerResponse):
    """The immediate reply of every call that returns a future."""

    request_id: Id
    model_id: str | None = None


class SampleFutureResponse(TinkerResponse):
    """asample's reply: one sequence id per sample, in the order of the result's sequences
    (the SDK asserts both)."""

    request_id: Id
    sample_sequence_ids: list[str]
    model_id: str | None = None


class RetrieveFutureRequest(TinkerRequest):
    request_id: Id
    allow_metadata_only: bool = False  # may be ignored: we always send the whole result


class TryAgainResponse(TinkerResponse):
    """Not ready yet: the SDK polls again at once."""

    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(TinkerResponse):
    """A failure after acceptance: the SDK raises RequestFailedError(error)."""

    error: str
    category: Literal["user", "server", "unknown"]


# -- checkpoints and runs -----------------------------------------------------------------------


class CheckpointsListResponse(TinkerResponse):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class WeightsInfoRequest(TinkerRequest):
    tinker_path: PathText


class WeightsInfoResponse(TinkerResponse):
    base_model: str
    optimizer_config: OptimizerConfigOut = OptimizerConfigOut()
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
