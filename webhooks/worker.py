"""The webhooks worker: a CPU Celery worker (thread pool) serving only the ``webhooks`` queue,
plus a step that moves due deliveries from ``bf:webhooks:scheduled`` back onto the queue.

``batchfleet webhooks worker --config fleet.toml``; run as many as you like, anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, bootsteps

from ..config import FleetConfig
from ..connection import connect
from ..schemas.keys import WEBHOOK_QUEUE, WebhookKeys
from .tasks import TASK_NAME

logger = logging.getLogger(__name__)

POLL_S = 0.5


def release_due(client: redis.Redis, app: Celery, now_ms: int, limit: int = 100) -> int:
    """Queue the scheduled deliveries due by ``now_ms``; returns how many were queued.

    ``ZREM`` decides which worker releases an entry, so with many workers each goes once.
    """
    key = WebhookKeys().scheduled
    released = 0
    for member in client.zrangebyscore(key, "-inf", now_ms, start=0, num=limit):
        if client.zrem(key, member) != 1:
            continue  # another worker took it
        entry = json.loads(member)
        app.send_task(
            TASK_NAME, kwargs=entry["kwargs"], retries=entry["retries"], queue=WEBHOOK_QUEUE
        )
        released += 1
    return released


class SchedulerStep(bootsteps.StartStopStep):
    """Polls the scheduled set on a thread while the worker runs."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, worker: Any) -> None:
        fleet: FleetConfig = worker.app.batchfleet_config
        client = connect(fleet.redis_url)
        self.thread = threading.Thread(
            target=self._run, args=(worker.app, client), name="webhook-scheduler", daemon=True
        )
        self.thread.start()

    def _run(self, app: Celery, client: redis.Redis) -> None:
        while not self.stopping.wait(POLL_S):
            try:
                release_due(client, app, int(time.time() * 1000))
            except Exception:
                logger.exception("webhook scheduler: releasing due deliveries failed")

    def stop(self, worker: Any) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(5)


def create_webhooks_app(fleet: FleetConfig) -> Celery:
    """The batchfleet Celery app without batch loops (no model is loaded), plus the scheduler."""
    from ..worker.app import BatchLoopStep, create_app

    app = create_app(fleet)
    app.steps["worker"].discard(BatchLoopStep)
    app.steps["worker"].add(SchedulerStep)
    return app


def run_worker(
    fleet: FleetConfig, *, name: str | None = None, concurrency: int | None = None, loglevel: str
) -> int:
    """Run a webhooks worker until SIGTERM/SIGINT."""
    app = create_webhooks_app(fleet)
    name = name or f"webhooks-{os.getpid()}"
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency or fleet.webhooks.concurrency}",
            f"--loglevel={loglevel}",
            f"--hostname={name if '@' in name else f'{name}@%h'}",
            f"--queues={WEBHOOK_QUEUE}",
            "--without-mingle",
            "--without-gossip",
        ]
    )
    return 0
