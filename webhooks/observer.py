"""The batch-loop observer that queues a delivery task for each newly stored result with a
webhook. It runs on the loop thread, so it only enqueues (one pipelined publish per batch
of results to the ``webhooks`` queue); the HTTP happens in a webhooks worker."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from ..config import FleetConfig
from ..schemas.keys import WEBHOOK_QUEUE
from ..worker.observers import Answered, LoopObserver
from .tasks import TASK_NAME, Delivery, webhook_id

logger = logging.getLogger(__name__)

PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.2}
"""Bounded: a broker outage must not hold the batch loop for long."""


def deliveries(answered: Sequence[Answered]) -> list[Delivery]:
    """The deliveries owed for these answers: newly stored results whose request has a webhook."""
    out: list[Delivery] = []
    for a in answered:
        if not a.stored or a.request is None or a.request.webhook is None:
            continue
        hook = a.request.webhook
        out.append(
            Delivery(
                model=a.result.model,
                request_id=a.result.id,
                url=hook.url,
                webhook_id=webhook_id(a.result.model, a.result.id, a.result.finished_at_ms),
                secret_id=hook.secret_id,
                format=hook.format or "json",
            )
        )
    return out


class WebhookObserver(LoopObserver):
    """Enqueues ``batchfleet.webhooks.deliver`` tasks; never touches the network itself."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def on_answered(self, model: str, answered: Sequence[Answered]) -> None:
        owed = deliveries(answered)
        if not owed:
            return
        with self.app.producer_or_acquire() as producer:
            for d in owed:
                self.app.send_task(
                    TASK_NAME,
                    kwargs=d.model_dump(),
                    queue=WEBHOOK_QUEUE,
                    producer=producer,
                    retry_policy=PUBLISH_RETRY,
                )
        logger.debug("queued %d webhook deliveries for %s", len(owed), model)


def webhook_observer(worker: Any, fleet: FleetConfig, model: str) -> LoopObserver:
    """Observer factory for ``app.batchfleet_observers``."""
    return WebhookObserver(worker.app)
