"""Errors of webhook delivery (under the root :class:`BatchfleetError`)."""

from __future__ import annotations

from ..schemas.errors import BatchfleetError


class WebhookError(BatchfleetError):
    """Something about a webhook delivery went wrong."""


class TargetRefused(WebhookError):
    """The URL is not allowed: scheme, or an address the SSRF policy forbids. Not retried."""


class NetworkError(WebhookError):
    """Connecting, sending or reading failed or timed out. Retried."""


class AttemptTimeout(NetworkError):
    """No complete response in time (a connect, a read, or the whole attempt). Retried."""


class DeliveryFailed(WebhookError):
    """The delivery gave up; it is in the dead-letter stream (``batchfleet webhooks list-failed``)."""
