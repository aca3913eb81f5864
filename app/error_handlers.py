"""One error shape everywhere: {"error": {"type", "message", "param", "details"}}."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, get_args, get_origin

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import ApiError, TooManyRequests
from trainer.config import JobSpec

log = logging.getLogger(__name__)

_LOCATIONS = {"body", "query", "path", "header", "cookie"}
# What a 503 for an unreachable database asks clients to wait: a restart takes seconds.
UNAVAILABLE_RETRY_AFTER_S = 2


def discriminated_union_tags(model: type[BaseModel]) -> frozenset[str]:
    """The tags of every discriminated union reachable from ``model``'s fields (nested models,
    lists and Annotated[..., Field(discriminator=...)] included): the values of each member's
    ``Literal`` discriminator field."""
    tags: set[str] = set()
    seen: set[type[BaseModel]] = set()

    def visit(tp: Any, discriminator: str | None) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp not in seen:
                seen.add(tp)
                for field in tp.model_fields.values():
                    disc = field.discriminator
                    visit(field.annotation, disc if isinstance(disc, str) else None)
            return
        if get_origin(tp) is Annotated:
            base, *metadata = get_args(tp)
            for meta in metadata:
                if isinstance(meta, FieldInfo) and isinstance(meta.discriminator, str):
                    discriminator = meta.discriminator
            visit(base, discriminator)
            return
        for member in get_args(tp):
            if (
                discriminator is not None
                and isinstance(member, type)
                and issubclass(member, BaseModel)
                and discriminator in member.model_fields
            ):
                tag_type = member.model_fields[discriminator].annotation
                tags.update(v for v in get_args(tag_type) if isinstance(v, str))
            visit(member, None)

    visit(model, None)
    return frozenset(tags)


# Discriminated unions put the tag in the error location (graders.0.regex.pattern); users wrote
# graders[0].pattern, so the tag is dropped from the path we report. Derived from the job spec,
# so a new grader type needs no change here.
_UNION_TAGS = discriminated_union_tags(JobSpec)

_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# The detail of the HTTPException FastAPI raises when parsing a request body fails.
_BODY_PARSE_DETAIL = "There was an error parsing the body"


def field_path(loc: Sequence[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    out = ""
    previous: Any = None
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(previous, int) and part in _UNION_TAGS:
            pass
        else:
            out += ("." if out else "") + str(part)
        previous = part
    return out or "body"


def error_response(
    status: int, error_type: str, message: str, param: str | None = None, details: Any = None
) -> JSONResponse:
    body: dict[str, Any] = {"type": error_type, "message": message, "param": param}
    if details is not None:
        body["details"] = details
    return JSONResponse({"error": body}, status_code=status)


def _validation_details(errors: Sequence[Any]) -> list[dict[str, Any]]:
    details = []
    for err in errors:
        message = str(err.get("msg", "invalid value"))
        message = message.removeprefix("Value error, ")
        path = field_path(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            # The location is the character offset of the syntax error, not a field.
            loc = list(err.get("loc", ()))
            reason = (err.get("ctx") or {}).get("error", "malformed")
            message = f"not valid JSON: {reason} at character {loc[-1] if loc else 0}"
            path = "body"
        elif err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            # The error sits on the union; the field the user got wrong is its tag.
            tag = str((err.get("ctx") or {}).get("discriminator", "type")).strip("'\"")
            path = f"{path}.{tag}"
        details.append({"param": path, "message": message})
    return details


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        response = error_response(
            exc.status_code, exc.error_type, exc.message, exc.param, exc.details
        )
        if isinstance(exc, TooManyRequests):
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = _validation_details(exc.errors())
        first = details[0] if details else {"param": "body", "message": "invalid request"}
        return error_response(
            422,
            "invalid_request_error",
            f"{first['param']}: {first['message']}",
            first["param"],
            details,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _STATUS_TYPES.get(exc.status_code, "http_error")
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_DETAIL:
            # FastAPI's answer when reading the body raised (JSON nested past the recursion
            # limit, a broken multipart stream): a 422 naming the body, like malformed JSON.
            return error_response(
                422,
                "invalid_request_error",
                "body: could not be parsed (malformed, or nested too deeply)",
                "body",
            )
        response = error_response(exc.status_code, error_type, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        response = error_response(
            503, "service_unavailable", "the database is unavailable; retry shortly"
        )
        response.headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER_S)
        return response

    for exc_type in (OperationalError, InterfaceError, DisconnectionError, PoolTimeout):
        app.add_exception_handler(exc_type, _unavailable)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal_error", "internal server error")
