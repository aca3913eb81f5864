"""Domain errors carry their HTTP status; `app.core.error_handlers` renders every one the same way:
{"error": {"type": ..., "message": ..., "param": ...}}."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status_code = 400
    error_type = "invalid_request_error"
    # The specific reason in the body's `code` (default: error_type).
    code: str | None = None
    # Seconds for the Retry-After header, where waiting helps (429, 503).
    retry_after: int | None = None

    def __init__(
        self, message: str, *, param: str | None = None, details: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details


class InvalidRequest(ApiError):
    status_code = 422
    code = "invalid_value"


class MalformedHeader(ApiError):
    """A request header the API reads (a stream cursor) that is not what it must be: the
    request itself is malformed, hence 400 rather than a field's 422."""

    status_code = 400
    code = "invalid_header"


class Unauthorized(ApiError):
    status_code = 401
    error_type = "authentication_error"


class CrossSiteRefused(ApiError):
    """A state-changing request authenticated by the session cookie without the header that
    only a same-origin script can add (app.sessions.deps.get_principal says why)."""

    status_code = 403
    error_type = "permission_error"
    code = "csrf_header_required"


class NotFound(ApiError):
    status_code = 404
    error_type = "not_found"


class Conflict(ApiError):
    status_code = 409
    error_type = "conflict"


class FileInUse(Conflict):
    """A file a job that has not ended still reads."""

    error_type = "file_in_use"


class Gone(ApiError):
    """The object was recorded but its content no longer exists (a deleted checkpoint)."""

    status_code = 410
    error_type = "gone"


class IdempotencyKeyReused(ApiError):
    status_code = 422
    error_type = "idempotency_key_reused"


class PayloadTooLarge(ApiError):
    status_code = 413
    error_type = "payload_too_large"


class ServiceUnavailable(ApiError):
    status_code = 503
    error_type = "service_unavailable"


class Overloaded(ServiceUnavailable):
    """A capacity this process shares between every tenant is full (python-grader sandboxes);
    `retry_after` becomes the Retry-After header, in whole seconds."""

    code = "capacity_exceeded"

    def __init__(self, message: str, *, retry_after: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = max(1, int(retry_after))


class IllegalTransition(ApiError):
    """A job status change the state machine does not allow (or lost a race)."""

    status_code = 409
    error_type = "invalid_state"


class TooManyRequests(ApiError):
    """A fair-use limit (request rate, open streams); `retry_after` becomes the Retry-After
    header, in whole seconds."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = max(1, int(retry_after))


class QuotaExceeded(TooManyRequests):
    """A project holds as many queued and running jobs as it may: finish or cancel one."""

    error_type = "quota_exceeded"
