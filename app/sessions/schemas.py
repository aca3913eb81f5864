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


class KeyOut(BaseModel):
    """An API key of the project, never its secret: the prefix is the part after `grpo_` in
    the key itself, so a leaked key can be matched to its id."""

    object: Literal["api_key"] = "api_key"
    id: str
    prefix: str = Field(description="The key reads grpo_<prefix>_<secret>.")
    name: str | None
    created_at: datetime
    revoked_at: datetime | None = Field(description="When it was revoked; null while it works.")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]
