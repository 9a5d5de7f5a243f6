"""The :class:`Unary` handler: a route answered once, from the whole result (the pooling
endpoints, ``/tokenize``, ...), its inputs split over several fleet requests where they
are more than one takes (:mod:`.split`), answered as one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ...schemas.errors import BatchfleetError
from ..aio import AsyncJob
from ..submit import new_request_id
from .endpoint import Answered, Endpoint
from .errors import ApiError, of_exception
from .handler import Handler
from .split import merged, part_ids, split
from .state import Gateway


class Unary(Handler):
    """An endpoint answered once from the result (embeddings, scores, ...); more inputs
    than a fleet request takes go as several (``split.py``), answered as one."""

    endpoint: Endpoint
    load_aware = True

    def initialize(self, gateway: Gateway, endpoint: Endpoint) -> None:  # type: ignore[override]
        super().initialize(gateway)
        self.endpoint = endpoint
        self.jobs: list[AsyncJob] = []

    async def post(self) -> None:
        body: Mapping[str, Any] = {}
        try:
            body = self.body_json()
            sub, _ = await self.gateway.served(self.endpoint.submission(body))
            await self.gateway.check_model(sub.model)
            if self.endpoint.encoder:
                await self.gateway.refuse_generator(sub.model)
            parts = split(sub, *await self.gateway.limits(sub.model))
            base = self.request_id(body).get("request_id") or new_request_id()
            for part, rid in zip(parts, part_ids(base, len(parts)), strict=True):
                self.jobs.append(await self.submit(part, body, rid))
            self.set_header("X-Request-Id", base)
            results = await self.gateway.results(self.jobs)
            if self.gone:
                return  # the client left (its request was cancelled)
            info = await self.gateway.model_info(sub.model)
            answered = Answered(f"{self.endpoint.id_prefix}-{base}", int(time.time()),
                                info.max_model_len if info is not None else None)  # fmt: skip
            result = merged(results)
            self.count_tokens(result)
            self.send_json(self.endpoint.answer(body, result, answered))
        except ApiError as exc:
            self._cancel_all()
            self.fail(exc)
        except BatchfleetError as exc:
            self._cancel_all()
            self.fail(of_exception(exc, body))

    def _cancel_all(self) -> None:
        """A part failed or the client left: the other parts are answered to nobody."""
        if len(self.jobs) > 1 or self.gone:
            for job in self.jobs:
                self.gateway.cancel(job)

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if not self._finished:
            self._cancel_all()

    def on_finish(self) -> None:
        super().on_finish()
        for job in self.jobs:
            self.gateway.inflight.discard(job)
