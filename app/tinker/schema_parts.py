"""The parts the Tinker API's JSON bodies (app.tinker.schemas) are made of: the two bases,
bounded strings and metadata, and the nested objects (a prompt and its sampling parameters,
LoRA and optimizer settings, a model's data, a checkpoint).

Requests ignore unknown fields (newer SDKs add some) and bound every string, list and map, so
a tenant cannot make us hold megabytes of tags. Responses forbid extras and require what the
SDK requires: it validates every reply strictly, and a missing field fails the user's call.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from app.tinker.names import CHECKPOINT_NAME
from app.tinker.wire import WireError

Id = Annotated[str, Field(min_length=1, max_length=128)]  # session, model, sampler, request ids
Text = Annotated[str, Field(max_length=256)]  # names, versions, model names
LongText = Annotated[str, Field(max_length=4096)]  # details, messages, tokens
PathText = Annotated[str, Field(min_length=1, max_length=512)]  # a tinker:// path
SeqId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # int32 on the wire (forward_backward)
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
Key = Annotated[str, Field(min_length=1, max_length=128)]
# A checkpoint's name (save_state("final")): one path segment, also a folder name on our disk.
CheckpointName = Annotated[str, Field(pattern=f"^{CHECKPOINT_NAME.pattern}$")]
Ttl = Annotated[int, Field(ge=1, le=10 * 366 * 86_400)]  # seconds a checkpoint is kept
MAX_PROMPT_TOKENS = 131_072  # a sanity bound; the model's context is the caller's check


def json_at_most(limit: int) -> AfterValidator:
    def check(value: Any) -> Any:
        if len(json.dumps(value, default=str)) > limit:
            raise ValueError(f"more than {limit} bytes of JSON")
        return value

    return AfterValidator(check)


# user_metadata: arbitrary JSON for runs (dict[str, Any] in the SDK), strings for checkpoints.
AnyMetadata = Annotated[dict[Key, Any], Field(max_length=64), json_at_most(16_384)]
StrMetadata = Annotated[dict[Key, Annotated[str, Field(max_length=1024)]], Field(max_length=64)]


class TinkerRequest(BaseModel):
    """A request: unknown fields are ignored, as newer SDKs add fields (refusing them would
    lock those clients out); ``model_*`` fields are the protocol's, not pydantic's."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TinkerResponse(BaseModel):
    """A reply: extras are forbidden, so a slip in a route fails here, not in the SDK."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# -- nested objects -------------------------------------------------------------------------------


class SupportedModel(TinkerResponse):
    model_name: str
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class FinishReason(TinkerRequest):
    type: Text  # "success", "errored" or "interrupted" in 0.38


class LoraConfig(TinkerRequest):
    rank: int = Field(ge=1, le=4096)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(TinkerRequest):
    """The optimizer family of a model: "adamw" (the default), or "dimuon" and whatever comes."""

    type: Annotated[str, Field(max_length=32)] = "adamw"


class OptimizerConfigOut(TinkerResponse):
    type: Literal["adamw"] = "adamw"


class ModelData(TinkerResponse):
    arch: str | None = None
    # Becomes the base_model of the sampling clients save_weights_and_get_sampling_client makes.
    model_name: str
    tokenizer_id: str | None = None

    @model_validator(mode="after")
    def _tokenizer_without_colon(self) -> ModelData:
        if self.tokenizer_id is not None and ":" in self.tokenizer_id:
            raise ValueError("tokenizer_id must hold no ':' (the SDK cuts it at the first one)")
        return self


class AdamParams(TinkerRequest):
    """One step's Adam(W) hyperparameters (the SDK sends all six every step)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    learning_rate: float = Field(default=1e-4, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)  # decoupled
    grad_clip_norm: float = Field(default=0.0, ge=0)  # 0: no clipping


class OptimizerParamsIn(TinkerRequest):
    """A non-Adam family's step ({"type": "dimuon", ...}): recognised so it can be refused."""

    type: Annotated[str, Field(max_length=32)]


class PromptChunk(TinkerRequest):
    """{"type": "encoded_text", "tokens": [...]}; image chunks are recognised to be refused."""

    type: Annotated[str, Field(max_length=32)] = "encoded_text"
    tokens: list[int] | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)


class ModelInput(TinkerRequest):
    chunks: list[PromptChunk] = Field(max_length=4096)

    def token_ids(self, where: str = "prompt") -> list[int]:
        """Every chunk's tokens in order (renderers send several), or WireError naming it."""
        tokens: list[int] = []
        for i, chunk in enumerate(self.chunks):
            at = f"{where}.chunks[{i}]"
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise WireError(f"{at}: {chunk.type} chunks are not supported")
            if any(t < 0 or t >= 2**31 for t in chunk.tokens):
                raise WireError(f"{at}: token ids must be in [0, 2^31)")
            tokens.extend(chunk.tokens)
            if len(tokens) > MAX_PROMPT_TOKENS:
                raise WireError(f"{where}: more than {MAX_PROMPT_TOKENS} tokens")
        if not tokens:
            raise WireError(f"{where}: no tokens")
        return tokens


StopString = Annotated[str, Field(min_length=1, max_length=256)]


class SamplingParams(TinkerRequest):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)  # None: the server's
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    # None: stop at EOS; []: never stop before max_tokens; strings or token ids otherwise.
    stop: (
        StopString
        | Annotated[list[StopString], Field(max_length=64)]
        | Annotated[list[int], Field(max_length=64)]
        | None
    ) = None
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = Field(default=-1, ge=-1)  # -1: no limit
    top_p: float = Field(default=1.0, gt=0, le=1)


class Checkpoint(TinkerResponse):
    checkpoint_id: str  # "<kind>/<name>"
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None  # None: never


class Cursor(TinkerResponse):
    offset: int
    limit: int
    total_count: int


class TrainingRun(TinkerResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
