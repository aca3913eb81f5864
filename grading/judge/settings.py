"""The operator's judge endpoints (``GRPO_JUDGE_*``): where ``score_model`` graders may call.

``GRPO_JUDGE_ENDPOINTS`` is JSON: a name -> ``{"base_url": "http://host:8001/v1", "api_key_env":
"JUDGE_KEY", "model": "served-model-name"}`` (``model`` optional). A job names an endpoint; its URL and key stay in the worker's (and the API's)
environment, so a tenant can neither point the service at an address of its choosing nor read
a key.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["JudgeEndpoint", "JudgeSettings", "build_judge_settings"]


class JudgeEndpoint(BaseModel):
    base_url: str = Field(description="An OpenAI-compatible API root, e.g. http://judge:8001/v1.")
    api_key_env: str | None = Field(
        default=None, description="The environment variable holding its key (none: no key)."
    )
    model: str | None = Field(
        default=None,
        description=(
            "The model this endpoint serves. When set, every call asks for it, whatever model "
            "the grader names: a grader written for OpenAI (model gpt-4o-2024-08-06) runs on "
            "this judge unchanged. Unset: the grader's model is sent as it is."
        ),
    )

    @field_validator("base_url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http(s) URL")
        return value.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class JudgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_JUDGE_", extra="ignore")

    endpoints: dict[str, JudgeEndpoint] = Field(default_factory=dict)
    timeout_s: float = Field(default=60.0, gt=0, le=600, description="One judge call.")
    batch_timeout_s: float = Field(default=900.0, gt=0, le=7200, description="One batch.")
    concurrency: int = Field(default=8, ge=1, le=256, description="Calls in flight.")
    retries: int = Field(default=3, ge=0, le=10, description="Retries of a failed call.")
    max_reply_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)


def build_judge_settings(**overrides: object) -> JudgeSettings:
    """The judge settings from the environment, with ``overrides`` on top (tests)."""
    return JudgeSettings(**overrides)  # type: ignore[arg-type]
