"""The settings of the Tinker API (app/tinker) and of the workers that hold its training models
(worker/tinker_model.py): session lifetimes and every bound a tenant's calls meet (environment
GRPO_TINKER_*). A part of :class:`app.core.settings.Settings` (which inherits these fields),
kept apart to keep that module readable."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobspec import PACKAGED_MODELS


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
        pairs = _alias_pairs(value)
        for name, target in pairs:
            if not name or target not in PACKAGED_MODELS:
                raise ValueError(
                    f"GRPO_TINKER_MODEL_ALIASES: {name}={target!r} is not NAME=PACKAGED with "
                    f"PACKAGED one of {', '.join(PACKAGED_MODELS)}"
                )
        return ",".join(f"{name}={target}" for name, target in pairs)

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
