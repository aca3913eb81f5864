"""Request and response bodies of /v1/session."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class SessionIn(BaseModel):
    """POST /v1/session: the API key to sign in with (or send it as Authorization: Bearer)."""

    model_config = {"extra": "forbid"}
    key: str | None = Field(default=None, max_length=200, description="An API key.")


class SessionOut(BaseModel):
    project_id: str
    project_name: str
    key_id: str = Field(description="The key this session acts as.")
    via: Literal["cookie", "bearer"] = Field(description="How this request was authenticated.")
    expires_at: datetime | None = Field(
        default=None, description="When the session cookie stops working; null for Bearer."
    )
