"""The error body, and the error responses documented on every route, so the published schema
matches what we send."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorBody(BaseModel):
    type: str = Field(description="Machine-readable error class.")
    message: str = Field(description="What went wrong, for people.")
    param: str | None = Field(default=None, description="Path of the offending field, if any.")
    code: str | None = Field(
        default=None,
        description="The specific reason (invalid_value, quota_exceeded, invalid_state, ...).",
    )
    details: list[Any] | None = Field(default=None, description="Every problem found, if several.")


class ErrorResponse(BaseModel):
    error: ErrorBody


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or invalid API key."},
    403: {
        "model": ErrorResponse,
        "description": "A write signed in by the session cookie without the X-Requested-With "
        "header (a cross-site request).",
    },
    404: {"model": ErrorResponse, "description": "No such object in this project."},
    413: {"model": ErrorResponse, "description": "Request body too large."},
    422: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    429: {
        "model": ErrorResponse,
        "description": "A fair-use limit (request rate, open streams, active jobs); see "
        "Retry-After.",
    },
    503: {"model": ErrorResponse, "description": "Database unavailable."},
}

CONFLICT: dict[str, Any] = {"model": ErrorResponse, "description": "Conflict."}

# The OpenAI-compatible paths (app.core.error_handlers.is_openai_path) answer 400 where the native
# API answers 422.
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    **{status: doc for status, doc in ERRORS.items() if status != 422},
}

# Chat and completions (app.gateway): OpenAI's errors, plus the gateway's own.
INFERENCE_ERRORS: dict[int | str, dict[str, Any]] = {
    **OPENAI_ERRORS,
    429: {
        "model": ErrorResponse,
        "description": "A fair-use limit: the key's request rate, the project's requests in "
        "flight (see Retry-After), or its daily token quota (`insufficient_quota`).",
    },
    502: {"model": ErrorResponse, "description": "The inference engine failed."},
    503: {
        "model": ErrorResponse,
        "description": "No inference process can answer now (`no_inference_server`, "
        "`engine_starting`, `memory_budget`, `inference_unavailable`); see Retry-After.",
    },
    504: {"model": ErrorResponse, "description": "The inference engine did not answer in time."},
}

# The answers of a server-sent event stream route (the job's and the project's).
SSE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "An SSE stream."},
    429: {
        "model": ErrorResponse,
        "description": "Too many open streams for this key or server (see Retry-After).",
    },
}
