"""The two Celery baselines, run by ``celery -A bench.celery_app worker --pool solo``.

``bench.per_request``: one Celery task per request (what users write without batchfleet).
``bench.batched``: a ``celery_batches.Batches`` task, flushed every 10 ms or at
``BENCH_MAX_BATCH`` requests. Both use the model the harness names in ``BENCH_MODEL``;
each result carries its batch size and batch id so the report can show them.
Configured from the environment (``BENCH_REDIS_URL``, ``BENCH_MODEL``, ``BENCH_MAX_BATCH``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from celery import Celery

PER_REQUEST_QUEUE = "bench.per_request"
BATCHED_QUEUE = "bench.batched"
FLUSH_INTERVAL_S = 0.010
TRANSPORT = {"priority_steps": [0, 1, 2], "sep": ":", "queue_order_strategy": "priority"}
"""Lanes map to Redis-transport priorities 0..2 (0 first), like batchfleet's lanes."""


def make_app(url: str) -> Celery:
    app = Celery("bench", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        broker_transport_options=TRANSPORT,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
    )
    return app


app = make_app(os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
_handler: Any = None


def handler() -> Any:
    """The model, loaded once per worker process (first task)."""
    global _handler
    if _handler is None:
        from bench.models import MODELS

        _handler = MODELS[os.environ["BENCH_MODEL"]].load()
    return _handler


@app.task(name="bench.infer")
def infer(text: str) -> dict[str, Any]:
    h = handler()
    (out,) = h.run(h.encode([text]))
    return {"b": 1, "bid": "", "ok": out is not None}


def _batched_task() -> Any:
    try:
        from celery_batches import Batches
    except ImportError:  # the per-request worker does not need it
        return None

    @app.task(
        name="bench.infer_batch",
        base=Batches,
        flush_every=int(os.environ.get("BENCH_MAX_BATCH", "32")),
        flush_interval=FLUSH_INTERVAL_S,
    )
    def infer_batch(requests: list[Any]) -> None:
        h = handler()
        outs = h.run(h.encode([r.args[0] for r in requests]))
        bid = uuid.uuid4().hex[:12]
        for r, out in zip(requests, outs, strict=True):
            app.backend.mark_as_done(
                r.id, {"b": len(requests), "bid": bid, "ok": out is not None}, request=r
            )

    return infer_batch


infer_batch = _batched_task()
