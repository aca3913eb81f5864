"""The API's settings of its inference gateway, POST /v1/chat/completions and /v1/completions
(app.gateway): what it sends the inference processes, its fair-use budgets and its request
bounds (environment GRPO_INFERENCE_*, beside the tier's own, inference.settings). A part of
:class:`app.core.settings.Settings` (which inherits these fields), kept apart to keep that
module readable."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The shortest GRPO_INFERENCE_TOKEN the API takes and `grpo inference` starts with (the two
# share it: inference.process refuses to start with a shorter one).
MIN_TOKEN_CHARS = 16


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", extra="ignore")

    inference_token: str | None = Field(
        default=None,
        min_length=MIN_TOKEN_CHARS,
        description=(
            "Shared secret the API sends as `Authorization: Bearer` to the inference processes "
            "(their control API and their vLLM servers); set the same on `grpo inference`, "
            "which refuses to start without one (`grpo serve` makes one for itself)."
        ),
    )
    inference_rate_limit_per_minute: int = Field(
        default=600,
        ge=1,
        description=(
            "Chat and completion requests per API key per minute (429 beyond); a budget of "
            "its own, apart from GRPO_RATE_LIMIT_PER_MINUTE."
        ),
    )
    inference_rate_limit_burst: int = Field(
        default=60, ge=1, description="Chat and completion requests an idle key may send at once."
    )
    inference_max_concurrent_per_project: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description=(
            "Chat and completion requests of one project in flight at once, streams included, "
            "across API processes when Redis is configured (429 with Retry-After beyond)."
        ),
    )
    inference_max_concurrent_per_process: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Chat and completion requests one API process proxies at once (429 beyond).",
    )
    inference_daily_tokens_per_project: int = Field(
        default=10_000_000,
        ge=0,
        description=(
            "Prompt plus completion tokens one project may use per UTC day; a request once the "
            "day's use has reached it is a 429 `insufficient_quota`. Requests in flight when "
            "it is reached still finish (the use can pass it by their tokens). 0: no limit."
        ),
    )
    inference_max_tokens: int = Field(
        default=4096,
        ge=1,
        le=1_000_000,
        description="Largest `max_tokens` / `max_completion_tokens` a request may ask for (400).",
    )
    inference_max_choices: int = Field(
        default=16,
        ge=1,
        le=1024,
        description=(
            "Most choices one request may ask for: `n`, times the number of prompts of a "
            "/v1/completions request (400 beyond)."
        ),
    )
    inference_max_prompt_chars: int = Field(
        default=400_000,
        ge=1,
        description=(
            "Most characters of a request's messages or prompts in all (token ids count one "
            "each); 400 beyond. The model's context is checked by the engine (also a 400)."
        ),
    )
    inference_ensure_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description=(
            "Longest the API waits for an inference process to make weights ready (an adapter "
            "load); an engine start answers 503 with Retry-After at once."
        ),
    )
    inference_read_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description=(
            "Longest the API waits for the engine's answer (non-streamed) or between two "
            "chunks of a stream; then 504 (before the first byte) or the stream ends."
        ),
    )
    inference_no_server_retry_after_s: int = Field(
        default=10,
        ge=1,
        le=3600,
        description="Retry-After of the 503 when no inference process serves the base model.",
    )
