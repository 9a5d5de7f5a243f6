"""OpenAI-style error answers: one exception, and how batchfleet's errors map onto it.

The body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``; ``code`` is
batchfleet's stable :class:`~batchfleet.schemas.errors.ErrorCode` string, so a client can
tell ``queue_full`` from ``too_large`` without reading the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...schemas.errors import (
    BatchfleetError,
    ErrorCode,
    JobFailed,
    QueueFull,
    RequestRejected,
    ResultTimeout,
    Unavailable,
)
from ...schemas.messages import Result

STATUS_OF_CODE: dict[str, int] = {
    ErrorCode.MALFORMED.value: 400,
    ErrorCode.INVALID_REQUEST.value: 400,
    ErrorCode.TOO_LARGE.value: 400,
    ErrorCode.EMPTY_INPUT.value: 400,
    ErrorCode.INVALID_INPUT.value: 400,
    ErrorCode.UNKNOWN_MODEL.value: 404,
    ErrorCode.QUEUE_FULL.value: 429,
    ErrorCode.DEADLINE_EXCEEDED.value: 504,
    ErrorCode.INFERENCE_FAILED.value: 500,
    ErrorCode.POISONED.value: 500,
    ErrorCode.INTERNAL.value: 500,
}
"""HTTP status per batchfleet error code (a code this gateway does not know: 500)."""

TYPE_OF_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An answer other than 200: its HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind
        """The error's ``type`` where it is not its status's (OpenAI's 404s of the
        Responses API are ``invalid_request_error``)."""
        self.extra = dict(extra or {})
        """Fields of the error object besides OpenAI's (a route's own)."""

    @property
    def type(self) -> str:
        return self.kind or TYPE_OF_STATUS.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                **self.extra,
            }
        }


def invalid(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request this gateway refuses before submitting it."""
    return ApiError(400, message, code=ErrorCode.INVALID_REQUEST.value, param=param)


def of_result(result: Result) -> ApiError:
    """The error a non-``ok`` result answers with (``expired``: 504)."""
    code = str(result.error.code.value if result.error and isinstance(result.error.code, ErrorCode)
               else result.error.code if result.error else ErrorCode.INTERNAL.value)  # fmt: skip
    message = result.error.message if result.error else f"request {result.status}"
    if result.status == "expired":
        code = ErrorCode.DEADLINE_EXCEEDED.value
    return ApiError(STATUS_OF_CODE.get(code, 500), message, code=code)


CLIENT_NAMES: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("max_tokens", "max_completion_tokens", "max_output_tokens"),
    "min_new_tokens": ("min_tokens",),
    "inputs": ("prompt", "input"),
    "messages": ("messages", "input"),
    "logprobs": ("top_logprobs", "logprobs"),
    "structured_outputs": ("structured_outputs", "guided_json", "guided_regex",
                           "guided_choice", "guided_grammar"),
}  # fmt: skip
"""batchfleet's request fields that the routes name otherwise: the name a route took
is the first of these its body holds (none: the first)."""


def client_param(param: str | None, body: Mapping[str, Any]) -> str | None:
    """A field at fault (batchfleet's name, :attr:`RequestRejected.param`) under the name
    the client sent it as, for OpenAI's ``param``."""
    if param is None:
        return None
    head = param.split(".", 1)[0].split("[", 1)[0]
    names = CLIENT_NAMES.get(head, (head,))
    return next((n for n in names if n in body), names[0]) + param[len(head) :]


def of_exception(exc: BatchfleetError, body: Mapping[str, Any] | None = None) -> ApiError:
    """The error a producer exception answers with; ``body``, the request as its client
    sent it, names a refused field as the client did."""
    if isinstance(exc, JobFailed):
        return of_result(exc.result)
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), code=ErrorCode.QUEUE_FULL.value)
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), code="unavailable")
    if isinstance(exc, ResultTimeout):
        return ApiError(504, str(exc), code="timeout")
    if isinstance(exc, RequestRejected):
        return ApiError(STATUS_OF_CODE.get(exc.code.value, 400), str(exc), code=exc.code.value,
                        param=client_param(exc.param, body or {}))  # fmt: skip
    return ApiError(500, str(exc), code=exc.code.value)
