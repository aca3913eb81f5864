"""The settings of the Tinker API (app/tinker) and of the workers that hold its training models
(worker/tinker_model.py): session lifetimes and every bound a tenant's calls meet (environment
GRPO_TINKER_*). A part of :class:`app.core.settings.Settings` (which inherits these fields),
kept apart to keep that module readable."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobspec import PACKAGED_MODELS
from jobspec.model_shape import PRESET_SHAPES

# What one sample call's KV cache may hold by default: 2 GiB on the larger packaged model,
# SmolLM2-135M, whose float32 cache (the Tinker workers' dtype) keeps a key and a value for 30
# layers x 3 KV heads x 64 dims, 46,080 bytes, a token: 2 GiB / 46,080 B = 46,603 tokens.
SAMPLE_CACHE_BYTES = 2 * 2**30
DEFAULT_SAMPLE_BATCH_TOKENS = SAMPLE_CACHE_BYTES // PRESET_SHAPES[
    "smollm2-135m-instruct"
].kv_bytes_per_token(4)


class TinkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", extra="ignore")

    tinker_session_ttl_s: float = Field(
        default=60.0,
        ge=15,
        le=86_400,
        description=(
            "A Tinker session whose client sent no heartbeat (every 10 s) for this long is over: "
            "its workers save nothing more, fail its queued calls and free their models."
        ),
    )
    tinker_max_sessions_per_project: int = Field(
        default=8, ge=1, le=10_000, description="Live Tinker sessions a project may hold."
    )
    tinker_max_models_per_project: int = Field(
        default=4,
        ge=1,
        le=1_000,
        description="Training clients (each a model resident on a worker) a project may hold.",
    )
    tinker_models_per_worker: int = Field(
        default=4,
        ge=1,
        le=64,
        description=(
            "Training clients one worker process holds at once (each a resident model): the "
            "session's own, and others no idle worker took."
        ),
    )
    tinker_max_queued_per_model: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Calls waiting for one training model; more are answered 429 (the SDK waits).",
    )
    tinker_max_chunk_datums: int = Field(
        default=256, ge=1, le=1024, description="Datums per forward_backward call (the SDK splits)."
    )
    tinker_max_body_bytes: int = Field(
        default=5_000_000,
        ge=10_000,
        le=100_000_000,
        description="Bytes of one forward_backward or sample body.",
    )
    tinker_max_tokens_per_call: int = Field(
        default=65_536, ge=64, le=10_000_000, description="Tokens of one forward_backward call."
    )
    tinker_max_samples_per_call: int = Field(
        default=64, ge=1, le=4096, description="num_samples of one sample call."
    )
    tinker_max_sample_tokens: int = Field(
        default=1024, ge=1, le=131_072, description="max_tokens of one sample call."
    )
    tinker_max_sample_batch_tokens: int = Field(
        default=DEFAULT_SAMPLE_BATCH_TOKENS,
        ge=1,
        le=100_000_000,
        description=(
            "Tokens one sample call may hold at once, num_samples x (prompt tokens + max_tokens): "
            "what the sampler's KV cache keeps. The default, 46,603, is 2 GiB of SmolLM2-135M's "
            "float32 cache (46,080 bytes a token)."
        ),
    )
    tinker_claim_timeout_s: float = Field(
        default=900.0,
        ge=30,
        le=86_400,
        description=(
            "A training client no worker took for this long (every worker busy with jobs or "
            "full of models) fails, with its queued calls, freeing the project's quota; until "
            "then its calls answer try_again with queue_state paused_capacity."
        ),
    )
    tinker_model_aliases: str = Field(
        default="",
        max_length=10_000,
        description=(
            "Other names for the packaged models, as NAME=PACKAGED pairs separated by commas "
            "(e.g. meta-llama/Llama-3.2-1B=tiny-random-llama): a training client may ask for "
            "NAME and trains PACKAGED. For clients that take the model's name from a table of "
            "their own, such as tinker-cookbook (docs/tinker-cookbook.md)."
        ),
    )

    @property
    def tinker_alias_map(self) -> dict[str, str]:
        """The aliases, NAME -> packaged model (validated at startup). Read when a client is
        created: its row records the packaged model (tinker_models.trained_model)."""
        return dict(_alias_pairs(self.tinker_model_aliases))

    @field_validator("tinker_model_aliases")
    @classmethod
    def _check_aliases(cls, value: str) -> str:
        """Each pair NAME=PACKAGED with PACKAGED a packaged model, and NAME a name of its own:
        not a packaged model's (it would change what that name trains), not given twice, and
        without ':' (``ft:...`` names and ``tinker://`` paths are saved weights' names, and the
        SDK cuts a model name at its first ':')."""
        pairs = _alias_pairs(value)
        packaged = {model.casefold(): model for model in PACKAGED_MODELS}
        seen: dict[str, str] = {}
        for name, target in pairs:
            pair = f"{name}={target}"
            if not name or target not in PACKAGED_MODELS:
                raise ValueError(
                    f"GRPO_TINKER_MODEL_ALIASES: {pair!r} is not NAME=PACKAGED with "
                    f"PACKAGED one of {', '.join(PACKAGED_MODELS)}"
                )
            if name.casefold() in packaged:
                raise ValueError(
                    f"GRPO_TINKER_MODEL_ALIASES: {pair!r} shadows the packaged model "
                    f"{packaged[name.casefold()]}; an alias is another name for one"
                )
            if ":" in name:
                raise ValueError(
                    f"GRPO_TINKER_MODEL_ALIASES: {pair!r}: an alias holds no ':' (ft:... names "
                    "and tinker:// paths name saved weights, and the SDK cuts a model name at "
                    "its first ':')"
                )
            if name in seen:
                raise ValueError(
                    f"GRPO_TINKER_MODEL_ALIASES: {name!r} is given twice ({seen[name]!r} and "
                    f"{pair!r})"
                )
            seen[name] = pair
        return ",".join(f"{name}={target}" for name, target in pairs)

    tinker_queue: str = Field(
        default="",
        max_length=200,
        description=(
            "The Celery queue Tinker training clients are sent on (empty: `<GRPO_QUEUE_NAME>-"
            "tinker`). Workers with GRPO_WORKER_SERVES=tinker or both consume it; an operator "
            "gives Tinker workers of its own with `tinker` on some and `jobs` on the others."
        ),
    )
    tinker_idle_release_s: float = Field(
        default=180.0,
        ge=5,
        le=86_400,
        description=(
            "A training client without a call for this long is written to disk and its worker "
            "freed, even while its session heartbeats; its next call loads it back where it "
            "was (weights, Adam state, gradients, sampler weights): a short wait, not an error."
        ),
    )
    tinker_max_workers_per_project: int = Field(
        default=2,
        ge=1,
        le=1_000,
        description=(
            "Workers one project's training clients may hold at once; its other clients wait "
            "for those workers (which hold up to GRPO_TINKER_MODELS_PER_WORKER each)."
        ),
    )
    tinker_max_stored_bytes_per_project: int = Field(
        default=256 * 1024 * 1024,
        ge=1_000_000,
        le=1_000_000_000_000,
        description=(
            "Bytes of a project's Tinker calls and results stored at once (a call's body until "
            "its worker applies it, a result until it is retrieved); past it a call is 429."
        ),
    )
    tinker_result_retention_s: float = Field(
        default=3600.0,
        ge=60,
        le=30 * 86_400,
        description=(
            "A result nobody retrieved is dropped after this long, and the call rows of an "
            "ended session are deleted this long after it ended."
        ),
    )
    tinker_max_polls_per_project: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description=(
            "retrieve_future polls one project may hold open at once in one API process; more "
            "are 429 (the SDK retries)."
        ),
    )

    tinker_poll_wait_s: float = Field(
        default=20.0,
        gt=0,
        le=40,
        description="How long retrieve_future holds a poll open (the SDK gives up at 45 s).",
    )


def _alias_pairs(value: str) -> list[tuple[str, str]]:
    """``NAME=PACKAGED`` pairs separated by commas, each part stripped (a pair without ``=``
    has an empty target, which the validator refuses)."""
    pairs = []
    for pair in value.split(","):
        if pair.strip():
            name, _, target = pair.partition("=")
            pairs.append((name.strip(), target.strip()))
    return pairs
