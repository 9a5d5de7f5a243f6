"""Stable error codes carried by ``error`` results, and the exception tree around them."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """The ``error.code`` of an error result. Values are part of the protocol."""

    MALFORMED = "malformed"
    """The entry is not decodable msgpack/JSON or not a map."""
    INVALID_REQUEST = "invalid_request"
    """A field is missing, of the wrong type, or out of bounds."""
    UNKNOWN_MODEL = "unknown_model"
    """The entry's ``model`` is not the model served on that stream."""
    TOO_LARGE = "too_large"
    """The entry, an input text, or the number of inputs is over its limit."""
    EMPTY_INPUT = "empty_input"
    """An input text is empty."""
    INFERENCE_FAILED = "inference_failed"
    """The model raised while computing this request."""
    POISONED = "poisoned"
    """Delivered too many times without an answer (it keeps failing or crashing workers);
    moved to the dead-letter stream."""
    QUEUE_FULL = "queue_full"
    """The lane is at its maximum depth (raised to producers, never stored as a result)."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """Used with status ``expired``: the deadline passed before it could be computed."""
    INTERNAL = "internal"
    """Anything else; the message says what."""


class BatchfleetError(Exception):
    """Root of every error batchfleet raises."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class RequestRejected(BatchfleetError):
    """A request failed validation; ``code`` says why."""

    code = ErrorCode.INVALID_REQUEST


class QueueFull(BatchfleetError):
    """The lane holds its maximum number of requests: back off and retry, or shed load."""

    code = ErrorCode.QUEUE_FULL


class Unavailable(BatchfleetError):
    """Redis cannot be reached (after retries with backoff)."""


class ConfigError(BatchfleetError):
    """The fleet configuration is invalid."""


class ResultTimeout(BatchfleetError, TimeoutError):
    """No result arrived within the time asked for."""


class JobFailed(BatchfleetError):
    """The result came back with status ``error`` or ``expired``."""

    def __init__(self, message: str, code: ErrorCode | str, result: object) -> None:
        super().__init__(message)
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
        self.result = result
