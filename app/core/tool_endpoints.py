"""The operator's tool and environment endpoints (``GRPO_TOOL_*``): where a job's http tools
and http environment may call (issue 27).

``GRPO_TOOL_ENDPOINTS`` is JSON: a name -> ``{"url": "http://tools:9000/calc", "api_key_env":
"CALC_KEY"}``, the registry's shape of the judge endpoints (``GRPO_JUDGE_ENDPOINTS``). A job
names an endpoint (``implementation: {type: http, endpoint: NAME}``, ``environment: {type: http,
endpoint: NAME}``); its URL and key stay in the environment of the API (which refuses an unknown
name at submission) and of the workers (which call it), so a tenant can neither point the service
at an address of its choosing nor read a key.

The protocol (the worker's side is :mod:`worker.agents`; every call a JSON POST, with
``Authorization: Bearer <key>`` when the endpoint has one):

- a tool: ``POST <url>`` with ``{"name": tool, "arguments": {...}}``; it answers
  ``{"content": "..."}`` (what the model reads) or ``{"error": "..."}`` (a tool error the model
  reads too);
- an environment: ``POST <url>/reset`` with ``{"episode_id", "item"}`` answers the messages
  that open the episode (a list of ``{role: user|system|tool, content}``), ``POST <url>/step``
  with ``{"episode_id", "messages"}`` (the assistant's turn) answers ``{"messages", "reward",
  "done"}``.

A call that times out (``episode.tool_timeout_s``), fails (connection, any status but 2xx),
answers more than ``GRPO_TOOL_MAX_RESPONSE_BYTES`` or answers something else is a tool error
(the model reads why) or ends the episode with reason error; it never fails the job.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ToolEndpoint", "ToolEndpointSettings", "build_tool_endpoint_settings"]


class ToolEndpoint(BaseModel):
    url: str = Field(description="The endpoint's http(s) URL (environments: reset/step below).")
    api_key_env: str | None = Field(
        default=None, description="The environment variable holding its key (none: no key)."
    )

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("url must be an http(s) URL")
        return value.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class ToolEndpointSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_TOOL_", extra="ignore")

    endpoints: dict[str, ToolEndpoint] = Field(default_factory=dict)
    max_response_bytes: int = Field(
        default=1 << 20, ge=1024, le=64 << 20, description="Of one answer; more is an error."
    )
    concurrency: int = Field(
        default=16, ge=1, le=256, description="Calls of one turn in flight at once."
    )


def build_tool_endpoint_settings(**overrides: object) -> ToolEndpointSettings:
    """The tool endpoint settings from the environment, with ``overrides`` on top (tests)."""
    return ToolEndpointSettings(**overrides)  # type: ignore[arg-type]
