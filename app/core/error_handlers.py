"""One error shape everywhere: {"error": {"type", "message", "param", "code", "details"}}.

`code` is the specific machine-readable reason (`quota_exceeded`, `invalid_state`,
`invalid_value`...); `type` its class. The shape is OpenAI's, so the `openai` SDK reads
`param`, `code` and `type` off our errors. Under the OpenAI-compatible paths
(`is_openai_path`) an invalid request is a 400, as OpenAI answers (the SDK's BadRequestError),
where the native API answers 422, and `type` takes OpenAI's class names."""

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

from app.core.errors import ApiError
from app.core.field_paths import field_path

log = logging.getLogger(__name__)

# What a 503 for an unreachable database asks clients to wait: a restart takes seconds.
UNAVAILABLE_RETRY_AFTER_S = 2


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


# Paths whose clients are OpenAI's SDKs: files, the fine-tuning API, the models, and chat and
# completions (app.gateway).
OPENAI_ROOTS = ("/v1/files", "/v1/models", "/v1/chat/completions", "/v1/completions")
OPENAI_PREFIXES = ("/v1/fine_tuning/", *(f"{root}/" for root in OPENAI_ROOTS))
# OpenAI's error classes by status (the SDK picks its exception by status; `type` is the class).
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# A final refusal (the state rules it out): the SDK would retry a 409 or 429 unless told not to.
NO_RETRY_CODES = frozenset({"invalid_state", "insufficient_quota"})


def is_openai_path(path: str) -> bool:
    """A path of the OpenAI-compatible surface (files, /v1/fine_tuning/..., models)."""
    return path in OPENAI_ROOTS or path.startswith(OPENAI_PREFIXES)


def error_response(
    status: int,
    error_type: str,
    message: str,
    param: str | None = None,
    details: Any = None,
    *,
    code: str | None = None,
    path: str = "",
) -> JSONResponse:
    """The error body (`code` defaults to `error_type`); under an OpenAI path, 422 becomes 400
    and `type` OpenAI's class for the status."""
    code = code or error_type
    if path and is_openai_path(path):
        status = 400 if status == 422 else status
        error_type = _OPENAI_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
    body: dict[str, Any] = {"type": error_type, "message": message, "param": param, "code": code}
    if details is not None:
        body["details"] = details
    response = JSONResponse({"error": body}, status_code=status)
    if code in NO_RETRY_CODES:
        response.headers["x-should-retry"] = "false"
    return response


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
        details.append({"param": path, "message": message, "literal": _is_literal(err)})
    # A value refused by every member of `"auto" | int`: the member that explains it is the
    # number's bound, not "should be 'auto'".
    explained = {d["param"] for d in details if not d["literal"]}
    return [
        {"param": d["param"], "message": d["message"]}
        for d in details
        if not (d["literal"] and d["param"] in explained)
    ]


def _is_literal(err: Any) -> bool:
    return any(isinstance(p, str) and p.startswith("literal[") for p in err.get("loc", ()))


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        response = error_response(
            exc.status_code,
            exc.error_type,
            exc.message,
            exc.param,
            exc.details,
            code=exc.code,
            path=request.url.path,
        )
        if exc.retry_after is not None:
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = _validation_details(exc.errors())
        first = details[0] if details else {"param": "body", "message": "invalid request"}
        return error_response(
            422,
            "invalid_request_error",
            f"{first['param']}: {first['message']}",
            first["param"],
            details,
            code="invalid_value",
            path=request.url.path,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _STATUS_TYPES.get(exc.status_code, "http_error")
        if exc.status_code == 400 and exc.detail == _BODY_PARSE_DETAIL:
            # FastAPI's answer when reading the body raised (JSON nested past the recursion
            # limit, a broken multipart stream): a 422 naming the body, like malformed JSON.
            return error_response(
                422,
                "invalid_request_error",
                "body: could not be parsed (malformed, or nested too deeply)",
                "body",
                code="invalid_value",
                path=request.url.path,
            )
        response = error_response(
            exc.status_code, error_type, str(exc.detail), path=request.url.path
        )
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", exc)
        response = error_response(
            503,
            "service_unavailable",
            "the database is unavailable; retry shortly",
            path=request.url.path,
        )
        response.headers["Retry-After"] = str(UNAVAILABLE_RETRY_AFTER_S)
        return response

    for exc_type in (OperationalError, InterfaceError, DisconnectionError, PoolTimeout):
        app.add_exception_handler(exc_type, _unavailable)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, "internal_error", "internal server error", path=request.url.path)
