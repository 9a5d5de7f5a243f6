"""The base :class:`Handler` of every route, and the JSON they write.

What each route shares whatever it answers: the API key check (open paths aside), CORS
preflights, OpenAI's error answers, the body as JSON, the client's request id, submitting
through the :class:`~.state.Gateway`, and the metrics and ``/load`` count of each request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Mapping
from typing import Any

import tornado.web

from ...redis_errors import refused_for_now
from ...schemas.errors import ErrorCode
from ...schemas.keys import REQUEST_ID
from ...schemas.messages import Result
from ..aio import AsyncJob
from .cors import Cors
from .endpoint import Submission
from .errors import ApiError, invalid
from .metrics import CLIENT_LEFT
from .replies import DOWN
from .state import Gateway

RETRY_AFTER_S = 1
"""A 503's ``Retry-After``, in seconds: a Redis restart or a cluster failover (its node
timeout, then an election) is over within seconds, and a retry then is served."""

OPEN_PATHS = frozenset({"/health", "/livez", "/ping", "/load", "/version", "/metrics"})
"""Paths answered without the API key: what probes, load balancers and Prometheus poll
(vLLM's ``PUBLIC_ENDPOINTS``, and ``/livez``)."""


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Made once: ``json.dumps`` with options makes one a call (one a streamed event)."""
_MAKE_C: Any = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE: Any = _MAKE_C and _MAKE_C(
    None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",", False, False, True
)
"""``_ENCODER``'s C encoder (absent on Pythons without one), made once too: its ``encode``
makes one a call (a third of its time on a chunk). No circular-reference check: what it
writes is built as a tree."""


def dumps(obj: Any) -> str:
    if _C_ENCODE is None:
        return _ENCODER.encode(obj)
    return "".join(_C_ENCODE(obj, 0))


def chosen_request_id(rid: object) -> dict[str, Any]:
    """A fleet request id a client chose, as submit options (none: empty); a 400 where it
    is not one."""
    if rid is None:
        return {}
    if not isinstance(rid, str) or not REQUEST_ID.match(rid):
        raise invalid("a request id has 1-128 of letters, digits and _.:-", "request_id")
    return {"request_id": rid}


class Handler(tornado.web.RequestHandler):
    """Shared by every route: the key check, OpenAI's error answers, the metrics."""

    gateway: Gateway
    load_aware = False
    """Its POST requests count in the gateway's :attr:`~Gateway.load` while answered."""

    def initialize(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.gone = False
        """The client closed the connection before its answer ended."""
        self.left = asyncio.Event()
        """Set as :attr:`gone` is (for what waits on something else meanwhile)."""
        self.route = gateway.route_of(self.request.path)
        self._measured = False
        gateway.metrics.started(self.route)
        self._loading = self.load_aware and self.request.method == "POST"
        gateway.load += self._loading

    def set_default_headers(self) -> None:
        """A cross-origin request's CORS headers (kept by :meth:`fail`'s ``clear``)."""
        cors: Cors | None = self.application.settings.get("cors")
        origin = self.request.headers.get("Origin")
        if cors is not None and origin is not None:
            for name, value in cors.simple(origin, self.request.headers).items():
                self.set_header(name, value)

    def prepare(self) -> None:
        if self._preflight():
            return
        if self.gateway.stopping and self.request.method == "POST":
            return self.fail(ApiError(503, "the gateway is shutting down", code="unavailable"))
        key = self.gateway.api_key
        # browsers send no key on a preflight: OPTIONS is not checked, as vLLM's
        if key is None or self.request.path in OPEN_PATHS or self.request.method == "OPTIONS":
            return
        given = self.request.headers.get("Authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = given[7:] if given.startswith("Bearer ") else self.request.headers.get(
            "x-api-key", "")  # fmt: skip
        if not hmac.compare_digest(token.encode(), key.encode()):
            self.fail(ApiError(401, "Incorrect API key: send Authorization: Bearer <key> "
                               "(or x-api-key: <key>)", code="invalid_api_key"))  # fmt: skip

    def _preflight(self) -> bool:
        """Answer a CORS preflight (on any path, before routing, as Starlette's middleware)
        where the gateway allows cross-origin requests (True: answered)."""
        cors: Cors | None = self.application.settings.get("cors")
        headers = self.request.headers
        method = headers.get("Access-Control-Request-Method")
        if cors is None or self.request.method != "OPTIONS" or method is None:
            return False
        if "Origin" not in headers:
            return False
        answer = cors.preflight(headers["Origin"], method,
                                headers.get("Access-Control-Request-Headers"))  # fmt: skip
        self.clear()
        for name, value in answer.headers.items():
            self.set_header(name, value)
        self.set_status(answer.status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(answer.text)
        return True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The JSON of an error answer: OpenAI's error object (a route may have its own)."""
        return error.body()

    def fail(self, error: ApiError) -> None:
        """Answer with ``error`` (nothing was sent yet); a 503 (Redis unreachable, a
        failover under way, shutting down) says when to try again (``Retry-After``)."""
        self.clear()
        self.set_status(error.status)
        if error.status == 503:
            self.set_header("Retry-After", str(RETRY_AFTER_S))
        self.set_header("Content-Type", "application/json")
        self.finish(dumps(self.error_body(error)))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """An exception no handler answered: Redis unreachable mid-request (a call outside
        the producer's retries), or refusing for now (``CLUSTERDOWN`` while a cluster fails
        over), is a 503, anything else a 500."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, DOWN) or (exc is not None and refused_for_now(exc)):
            error = ApiError(503, f"Redis unreachable: {exc}", code="unavailable")
        elif status_code >= 500:
            error = ApiError(status_code, "internal server error", code=ErrorCode.INTERNAL.value)
        else:
            error = ApiError(status_code, self._reason)
        self.fail(error)

    def send_json(self, obj: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(dumps(obj))

    def body_json(self) -> Mapping[str, Any]:
        try:
            body = json.loads(self.request.body or b"null")
        except ValueError as exc:
            raise invalid(f"the body is not JSON: {exc}") from None
        if not isinstance(body, Mapping):
            raise invalid("the body must be a JSON object")
        return body

    def request_id(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The fleet request id the client chose (``X-Request-Id`` or vLLM's ``request_id``):
        resubmitted, the same id gets the same single result."""
        return chosen_request_id(self.request.headers.get("X-Request-Id") or body.get("request_id"))

    async def submit(
        self, sub: Submission, body: Mapping[str, Any], request_id: str | None = None
    ) -> AsyncJob:
        chosen = self.request_id(body).get("request_id")
        job = await self.gateway.submit(sub, chosen if request_id is None else request_id)
        self.gateway.inflight.add(job)
        self.set_header("X-Request-Id", job.id)
        return job

    def count_tokens(self, result: Result) -> None:
        """An ``ok`` result's tokens, in the metrics."""
        if result.usage is not None:
            usage = result.usage
            self.gateway.metrics.tokens(result.model, usage.prompt_tokens, usage.completion_tokens)

    def _measured_as(self, status: int) -> None:
        if not self._measured:
            self._measured = True
            self.gateway.load -= self._loading
            self.gateway.metrics.ended(self.route, self.request.method or "", status,
                                       self.request.request_time())  # fmt: skip

    def on_connection_close(self) -> None:
        self.gone = True
        self.left.set()
        if not self._finished:
            self._measured_as(CLIENT_LEFT)

    def on_finish(self) -> None:
        self._measured_as(CLIENT_LEFT if self.gone else self.get_status())
        job = getattr(self, "job", None)
        if job is not None:
            self.gateway.inflight.discard(job)
