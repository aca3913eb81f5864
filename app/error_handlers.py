"""One error shape everywhere: {"error": {"type", "message", "param", "details"}}."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import ApiError

log = logging.getLogger(__name__)

_LOCATIONS = {"body", "query", "path", "header", "cookie"}
# Discriminated unions put the tag in the error location (graders.0.regex.pattern); users wrote
# graders[0].pattern, so the tag is dropped from the path we report.
_UNION_TAGS = {"exact_match", "numeric_match", "regex", "length", "arithmetic"}

_STATUS_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_request_error",
    503: "service_unavailable",
}


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
        if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            # The error sits on the union; the field the user got wrong is its tag.
            tag = str((err.get("ctx") or {}).get("discriminator", "type")).strip("'\"")
            path = f"{path}.{tag}"
        details.append({"param": path, "message": message})
    return details


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status_code, exc.error_type, exc.message, exc.param, exc.details)

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
        response = error_response(exc.status_code, error_type, str(exc.detail))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        return error_response(
            503, "service_unavailable", "the database is unavailable; retry shortly"
        )

    for exc_type in (OperationalError, InterfaceError, DisconnectionError, PoolTimeout):
        app.add_exception_handler(exc_type, _unavailable)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal_error", "internal server error")
