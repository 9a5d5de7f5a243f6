"""vLLM's server routes beside its APIs: ``GET /version``, ``GET /load`` (its
``server_load``), and SageMaker's ``GET``/``POST /ping`` and ``POST /invocations``.

``/invocations`` serves any request of the gateway's APIs that vLLM's does, told apart by
its body as vLLM tells them (it tries each request type in turn, chat first): here by
the fields each API requires, in the same order, and, for ``input``, by the model's task
as its workers published it (vLLM's model has one task; a fleet serves several models).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ... import __version__
from .endpoint import Endpoint
from .errors import ApiError, invalid
from .generate import Generate
from .handler import Handler
from .info_routes import Health
from .pooling import CLASSIFY, EMBEDDINGS, RERANK, SCORE
from .state import Gateway
from .unary import Unary

CLASSIFIER = "text-classification"
"""The task (``bf:{model}:info``) whose ``input`` is a classification, not an embedding."""
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"))
"""The pairs of fields of a score request (vLLM's, then the newer names)."""


class Version(Handler):
    """``GET /version``: the gateway's batchfleet version (vLLM's shows vLLM's; open, as
    vLLM's)."""

    def get(self) -> None:
        self.send_json({"version": __version__})


class Load(Handler):
    """``GET /load``: vLLM's ``{"server_load": N}``, the requests to the fleet's routes this
    gateway is answering now (what a load balancer in front of several gateways reads)."""

    def get(self) -> None:
        self.send_json({"server_load": self.gateway.load})


class Ping(Health):
    """SageMaker's ``GET`` and ``POST /ping``: ``/health`` (readiness)."""

    async def post(self) -> None:
        await self.get()


async def invoked(gateway: Gateway, body: Mapping[str, Any]) -> bool | Endpoint:
    """The API whose request ``body`` is, by the fields it requires, in vLLM's order: a chat
    (``messages``: True), a completion (``prompt``: False), an embedding (``input``; a
    classification where the model's workers publish a classifier's task), a rerank
    (``query`` and ``documents``), a score (``text_1`` and ``text_2``, or ``queries`` and
    ``documents``); else a 400."""
    if "messages" in body:
        return True
    if "prompt" in body:
        return False
    if "input" in body:
        model = body.get("model")
        info = await gateway.model_info(model) if isinstance(model, str) else None
        return CLASSIFY if info is not None and info.task == CLASSIFIER else EMBEDDINGS
    if "query" in body and "documents" in body:
        return RERANK
    if any(all(f in body for f in pair) for pair in SCORE_FIELDS):
        return SCORE
    raise invalid("the body is no request /invocations serves: give `messages` (a chat), "
                  "`prompt` (a completion), `input` (embeddings, or a classifier's "
                  "classification), `query` and `documents` (a rerank), or `text_1` and "
                  "`text_2` (a score)", "messages")  # fmt: skip


class Invocations(Generate, Unary):
    """SageMaker's ``POST /invocations``: answered by the route whose request the body is
    (:func:`invoked`), as that route answers it, streamed too. Both kinds of handler in
    one, as the route is known only once the body is read."""

    def initialize(self, gateway: Gateway) -> None:  # type: ignore[override]
        Handler.initialize(self, gateway)  # each route's part is set once the route is known
        self.serves(chat=True)
        self.jobs = []

    async def post(self) -> None:
        try:
            route = await invoked(self.gateway, self.body_json())
        except ApiError as exc:
            return self.fail(exc)
        if isinstance(route, Endpoint):
            self.endpoint = route
            return await Unary.post(self)
        self.serves(route)
        await Generate.post(self)
