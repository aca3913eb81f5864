"""The parts the Tinker API's JSON bodies (app.tinker.schemas) are made of: the two bases,
bounded strings and metadata, and the nested objects (a prompt and its sampling parameters,
LoRA and optimizer settings, a model's data, a checkpoint).

Requests ignore unknown fields (newer SDKs add some) and bound every string, list and map, so
a tenant cannot make us hold megabytes of tags. Responses forbid extras and require what the
SDK requires: it validates every reply strictly, and a missing field fails the user's call.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

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
MAX_JSON_DEPTH = 16  # levels of arrays and objects in a stored JSON value
# Sampling parameters below these are degenerate: the worker divides the logits by the
# temperature and keeps the tokens whose probabilities before them sum below top_p, both in
# float32, where 1e-300 is 0 (logits / 0 and an empty top-p set: NaN probabilities). At
# 1e-3 logits stay far inside float32 and the most probable token is always kept; temperature
# 0 is greedy decoding.
MIN_TEMPERATURE = 1e-3
MIN_TOP_P = 1e-3

# The pydantic error type of a value the schema reads but this server refuses (a number that
# is not finite, a degenerate sampling parameter): the routes answer it with a 400 naming the
# field (app.tinker.routes.parse_json), as they do a value refused against the model or a limit;
# a body that does not fit the schema is a 422. Both are errors the SDK does not retry.
REFUSED_VALUE = "refused_value"
REFUSED_ERROR_TYPES = frozenset({REFUSED_VALUE, "finite_number"})


def refused_value(problem: str) -> PydanticCustomError:
    return PydanticCustomError(REFUSED_VALUE, "{problem}", {"problem": problem})


def json_at_most(limit: int) -> AfterValidator:
    def check(value: Any) -> Any:
        if len(json.dumps(value, default=str)) > limit:
            raise ValueError(f"more than {limit} bytes of JSON")
        return value

    return AfterValidator(check)


def _json_problem(value: Any, at: str, depth: int) -> str | None:
    """Why ``value`` (parsed JSON, ``at`` its path) is not one a json column stores, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return (
            f"{at or 'the value'}: {value} is not a JSON number (NaN, Infinity, -Infinity and "
            "numbers beyond 1.8e308 are refused)"
        )
    if isinstance(value, dict):
        items = [(f"{at}.{key}" if at else str(key), item) for key, item in value.items()]
    elif isinstance(value, list):
        items = [(f"{at}[{i}]", item) for i, item in enumerate(value)]
    else:
        return None
    if items and depth >= MAX_JSON_DEPTH:
        return f"{at or 'the value'}: nested deeper than {MAX_JSON_DEPTH} levels"
    for where, item in items:
        problem = _json_problem(item, where, depth + 1)
        if problem is not None:
            return problem
    return None


def storable_json(limit: int) -> AfterValidator:
    """A JSON value a json column stores (Postgres's json refuses NaN and Infinity): finite
    numbers at most ``MAX_JSON_DEPTH`` levels deep (a 400 otherwise), at most ``limit``
    bytes."""

    def check(value: Any) -> Any:
        if len(json.dumps(value, default=str)) > limit:  # first: the walk reads what is bounded
            raise ValueError(f"more than {limit} bytes of JSON")
        problem = _json_problem(value, "", 0)
        if problem is not None:
            raise refused_value(problem)
        return value

    return AfterValidator(check)


# user_metadata: arbitrary JSON for runs (dict[str, Any] in the SDK), strings for checkpoints.
AnyMetadata = Annotated[dict[Key, Any], Field(max_length=64), storable_json(16_384)]
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
    """A sample call's parameters; ``temperature`` 0 (greedy) or at least MIN_TEMPERATURE,
    ``top_p`` in [MIN_TOP_P, 1] (a 400 otherwise)."""

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
    temperature: float = 1.0  # 0: greedy
    top_k: int = Field(default=-1, ge=-1)  # -1: no limit
    top_p: float = 1.0  # 1: no limit

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if value != 0 and not value >= MIN_TEMPERATURE:
            raise refused_value(
                f"{value} is degenerate: 0 (greedy decoding) or at least {MIN_TEMPERATURE}"
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        if not MIN_TOP_P <= value <= 1:
            raise refused_value(f"{value} is outside [{MIN_TOP_P}, 1] (1: no limit)")
        return value


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
