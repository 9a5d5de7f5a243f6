"""The webhooks worker: a CPU Celery worker (thread pool) serving only the ``webhooks`` queue,
plus a step that moves due deliveries from ``bf:webhooks:scheduled`` back onto the queue.

``batchfleet webhooks worker --config fleet.toml``; run as many as you like, anywhere.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
import threading
import time
from typing import Any

from celery import Celery, bootsteps

from ..config import FleetConfig
from ..connection import SyncClient, connect
from ..schemas.keys import WEBHOOK_QUEUE, WebhookKeys
from .tasks import SCHEDULED, TASK_NAME

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""Longest sleep of the scheduler: entries other workers schedule are seen within this."""
CLAIM_LEASE_MS = 30_000
"""A claimed entry is due again after this unless its worker queued and removed it."""
CLAIM_LIMIT = 100

_CLAIM = (
    importlib.resources.files(__package__).joinpath("lua").joinpath("claim_due.lua").read_text()
)


class Scheduler:
    """Moves due deliveries from ``bf:webhooks:scheduled`` onto the ``webhooks`` queue.

    Claiming is a script that pushes a due entry's score a lease into the future; the entry is
    removed only once its task is queued, so a worker killed in between loses nothing (another
    releases it when the lease ends). With many workers each entry is claimed by one.
    """

    def __init__(self, client: SyncClient, app: Celery) -> None:
        self.client = client
        self.app = app
        self.key = WebhookKeys().scheduled
        self._claim = client.register_script(_CLAIM)

    def release_due(self, now_ms: int) -> tuple[int, int | None]:
        """Queue the deliveries due by ``now_ms``: how many, and when the next one is due."""
        claimed, first = self._claim(keys=[self.key], args=[now_ms, CLAIM_LIMIT, CLAIM_LEASE_MS])
        for member in claimed:
            entry = json.loads(member)
            self.app.send_task(
                TASK_NAME, kwargs=entry["kwargs"], retries=entry["retries"], queue=WEBHOOK_QUEUE
            )
            self.client.zrem(self.key, member)
        return len(claimed), None if first is None else int(float(first))

    def pause_s(self, released: int, next_due_ms: int | None, now_ms: int) -> float:
        """How long to sleep before looking again."""
        if released >= CLAIM_LIMIT:
            return 0.0
        if next_due_ms is None:
            return POLL_S
        return min(POLL_S, max(0.01, (next_due_ms - now_ms) / 1000))


class SchedulerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Runs the :class:`Scheduler` on a thread while the worker runs."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, worker: Any) -> None:
        fleet: FleetConfig = worker.app.batchfleet_config
        scheduler = Scheduler(connect(fleet.redis_url), worker.app)
        self.thread = threading.Thread(
            target=self._run, args=(scheduler,), name="webhook-scheduler", daemon=True
        )
        self.thread.start()

    def _run(self, scheduler: Scheduler) -> None:
        while not self.stopping.is_set():
            SCHEDULED.clear()  # before looking: a delivery scheduled from now on wakes us
            now_ms = int(time.time() * 1000)
            try:
                released, next_due = scheduler.release_due(now_ms)
            except Exception:
                logger.exception("webhook scheduler: releasing due deliveries failed")
                released, next_due = 0, None
            SCHEDULED.wait(scheduler.pause_s(released, next_due, now_ms))

    def stop(self, worker: Any) -> None:
        self.stopping.set()
        SCHEDULED.set()
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
    if concurrency:  # the slow lane is sized from it (see endpoints)
        fleet.webhooks.concurrency = concurrency
    app = create_webhooks_app(fleet)
    name = name or f"webhooks-{os.getpid()}"
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={fleet.webhooks.concurrency}",
            f"--loglevel={loglevel}",
            f"--hostname={name if '@' in name else f'{name}@%h'}",
            f"--queues={WEBHOOK_QUEUE}",
            "--without-mingle",
            "--without-gossip",
        ]
    )
    return 0
