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


class ModelNotFound(NotFound):
    """A model name this project cannot use: unknown, another project's, a deleted job's, a
    pruned checkpoint's. One answer for all of them, so a name never tells whether it exists
    in another project."""

    code = "model_not_found"


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


class RetryLater(ApiError):
    """A refusal that says when to try again: `retry_after` (seconds, at least 1, whole)
    becomes the Retry-After header."""

    def __init__(self, message: str, *, retry_after: float, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = max(1, int(retry_after))


class Overloaded(RetryLater, ServiceUnavailable):
    """A capacity this process shares between every tenant is full (python-grader sandboxes,
    upload decoding slots)."""

    code = "capacity_exceeded"


class IllegalTransition(ApiError):
    """A job status change the state machine does not allow (or lost a race)."""

    status_code = 409
    error_type = "invalid_state"


class TooManyRequests(RetryLater):
    """A fair-use limit (request rate, open streams, a project's share of a capacity)."""

    status_code = 429
    error_type = "rate_limit_error"


class QuotaExceeded(TooManyRequests):
    """A project holds as many queued and running jobs as it may: finish or cancel one."""

    error_type = "quota_exceeded"


class InferenceUnavailable(RetryLater, ServiceUnavailable):
    """No inference process can answer for the model now: none serves its base model, its
    engine is starting or out of memory budget, or every one is unreachable. `code` says which;
    the openai SDK retries a 503 after Retry-After by itself."""

    def __init__(self, message: str, *, retry_after: float, code: str) -> None:
        super().__init__(message, retry_after=retry_after)
        self.code = code


class UpstreamRefused(ApiError):
    """The inference engine refused the request as invalid (a prompt past the model's context,
    a schema it cannot compile): its own 4xx status and message, passed on."""

    code = "invalid_request"

    def __init__(self, message: str, *, status_code: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.status_code = status_code


class UpstreamFailed(ApiError):
    """The inference engine failed (a 5xx of its own, a dropped connection): 502."""

    status_code = 502
    error_type = "upstream_error"


class UpstreamTimeout(ApiError):
    """The inference engine did not answer within GRPO_INFERENCE_READ_TIMEOUT_S: 504."""

    status_code = 504
    error_type = "upstream_timeout"


class InsufficientQuota(TooManyRequests):
    """The project's daily inference token quota is used up: 429 `insufficient_quota` (OpenAI's
    code), not retried by the SDK (waiting seconds does not help; Retry-After says when the day
    ends)."""

    error_type = "insufficient_quota"
    code = "insufficient_quota"
