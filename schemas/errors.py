"""Stable error codes carried by ``error`` results, and the exception tree around them."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any


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
    INVALID_INPUT = "invalid_input"
    """An input this model cannot take: a corrupt, truncated, too big or disallowed image, a
    missing image key, or a kind of input the model does not take (an image for a text model)."""
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

    def __init__(
        self, message: str, code: ErrorCode | None = None, param: str | None = None
    ) -> None:
        super().__init__(message, code)
        self.param = param
        """The field at fault under batchfleet's name (``messages[0].content``), where one
        is known: the gateway names it as its route does in OpenAI's ``param``."""


class QueueFull(BatchfleetError):
    """The lane holds its maximum number of requests: back off and retry, or shed load."""

    code = ErrorCode.QUEUE_FULL
    accepted: list[Any]
    """From ``submit_many``: the jobs that did go in before the lane filled up."""

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message, code)
        self.accepted = []


class Unavailable(BatchfleetError):
    """Redis cannot be reached (after retries with backoff).

    ``unknown_ids``: requests that may or may not have been added (the connection failed
    mid-call). Submit them again with the same ids (``request_id=``): a duplicate entry gets
    the same single result. ``accepted``: from ``submit_many``, the jobs that did go in.
    """

    def __init__(self, message: str, unknown_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unknown_ids = list(unknown_ids)
        self.accepted: list[Any] = []


class ProducerClosed(BatchfleetError, RuntimeError):
    """The :class:`AsyncProducer` was closed: a call made after, or one waiting (for a
    result, a token stream) when it closed, ends with this rather than waiting on."""


class ConfigError(BatchfleetError, ValueError):
    """The fleet configuration is invalid (a ``ValueError`` too, so pydantic validators
    report it as a validation error)."""


class ResultTimeout(BatchfleetError, TimeoutError):
    """No result arrived within the time asked for."""


class JobFailed(BatchfleetError):
    """The result came back with a status other than ``ok`` (``error``, ``expired``, or a
    status this client does not know).

    ``code`` is the :class:`ErrorCode`, or ``INTERNAL`` for a code this client does not know;
    ``error_code`` is the code as sent, ``status`` the status as sent.
    """

    def __init__(self, message: str, code: ErrorCode | str, result: Any) -> None:
        super().__init__(message)
        known = code in ErrorCode._value2member_map_
        self.code = ErrorCode(code) if known else ErrorCode.INTERNAL
        self.error_code = str(code.value if isinstance(code, ErrorCode) else code)
        self.status: str = str(getattr(result, "status", "error"))
        self.result = result


class NotStreamed(BatchfleetError, ValueError):
    """``job.stream()`` or ``job.deltas()`` on a request submitted without ``stream=True``:
    no worker writes its token stream (``job.result()`` has its text)."""


class StreamRestarted(BatchfleetError):
    """A generating request was started again by another worker (its worker died) and the new
    text differs from what ``job.stream()`` already yielded: that text is void. The request
    still gets one final result: ``job.result()`` has the text to keep."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id
