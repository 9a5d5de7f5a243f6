"""The Celery application: a batchfleet worker is a Celery worker with a batch-loop step.

Flower, ``celery inspect`` and remote control see the worker like any other; the
micro-batch loops run in threads owned by a worker bootstep (not a consumer step,
so a broker reconnect does not restart them).

Start it with ``batchfleet worker --config fleet.toml``, or with plain Celery:
``BATCHFLEET_CONFIG=fleet.toml celery -A batchfleet.worker.app worker -P solo``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, bootsteps, signals

from ..config import FleetConfig, load_config
from ..connection import connect, default_url
from ..webhooks import tasks as webhook_tasks
from ..webhooks.observer import webhook_observer
from . import control
from .events import batch_task_name, flower_events
from .health import Health, HealthServer
from .loop import BatchLoop
from .metrics import prometheus_metrics
from .observers import LoopObserver
from .runner import is_continuous
from .runners import resolve

ObserverFactory = Callable[[Any, FleetConfig, str], LoopObserver]

logger = logging.getLogger(__name__)

CELERY_QUEUE = "batchfleet"

TERMINATE_JOIN_S = 5.0
"""A cold shutdown's wait for the loops to hand their requests back (no step is waited
for: a thread still in a Redis call past this is left, and the entries it held are
reclaimed by other workers after ``claim_idle_ms``)."""


class BatchLoopStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Loads each served model once (in the worker process: never forked after CUDA init)
    and runs its batch loop on a thread until the worker stops."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.loops: list[BatchLoop] = []
        self.threads: list[threading.Thread] = []
        self.health = Health()
        self.health_server: HealthServer | None = None
        self.hostname = ""

    def start(self, worker: Any) -> None:
        app = worker.app
        self.hostname = worker.hostname
        # A second Ctrl-C during a warm shutdown is a cold one that never reaches terminate()
        # (the blueprint is already stopping): Celery's signal handler sends this.
        signals.worker_shutting_down.connect(self._shutting_down, weak=False)
        fleet: FleetConfig = app.batchfleet_config
        if fleet.health.port is not None:  # up first: it answers "unready" while models load
            self.health_server = HealthServer(self.health, fleet.health.host, fleet.health.port)
            self.health_server.start()
        only: list[str] | None = app.batchfleet_models
        burst: bool = app.batchfleet_burst
        names = only or list(fleet.models)
        if not names:
            raise RuntimeError("no models configured: add [models.<name>] to the fleet file")
        consumer = fleet.worker.name or worker.hostname
        client = connect(fleet.redis_url, socket_timeout=fleet.worker.block_ms / 1000 + 10)
        for name in names:
            if name not in fleet.models:
                raise RuntimeError(
                    f"model {name!r} is not in the fleet file ({sorted(fleet.models)})"
                )
            cfg = fleet.models[name]
            self.health.loading(name)
            started = time.monotonic()
            runner = resolve(cfg.runner)(
                cfg.resolved_path(),
                device=cfg.device,
                dtype=cfg.dtype,
                max_tokens=cfg.max_tokens,
                options=cfg.options,
            )
            logger.info(
                "model %s loaded in %.1fs: %s", name, time.monotonic() - started, runner.info()
            )
            if is_continuous(runner):
                from .device import keep_freed_memory

                logger.info("malloc keeps freed memory (generation): %s", keep_freed_memory())
            observers = [make(worker, fleet, name) for make in app.batchfleet_observers]
            loop = BatchLoop(
                name,
                cfg,
                runner,
                client,
                consumer=consumer,
                worker=fleet.worker,
                burst=burst,
                observers=observers,
            )
            self.loops.append(loop)
        for loop in self.loops:  # with each heartbeat: where control broadcasts reach it
            if loop.streams is not None:
                loop.streams.identify(hostname=worker.hostname)
        for loop in self.loops:
            thread = threading.Thread(
                target=self._serve, args=(loop, burst), name=f"batchloop-{loop.model}", daemon=True
            )
            self.threads.append(thread)
            thread.start()
        self.health.serving(self.threads, {loop.model: loop.hung_for for loop in self.loops},
                            {loop.model: loop.broken for loop in self.loops})  # fmt: skip

    def _serve(self, loop: BatchLoop, burst: bool) -> None:
        """Run a loop; restart it after an unexpected error (its held entries stay pending and
        are reclaimed), and in burst mode stop the worker once every loop is idle."""
        while not loop.stopping:
            try:
                loop.run()
                break
            except Exception:
                logger.exception("batch loop of %s crashed; restarting in 1s", loop.model)
                time.sleep(1.0)
                if not loop.settle():  # stopped while its device thread was stuck in a step
                    break
                loop.reset()
        if burst and all(lp.wait_stopped(0) for lp in self.loops):
            logger.info("burst mode: all streams drained, stopping the worker")
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self, worker: Any) -> None:
        """Warm shutdown: the steps running finish and are stored (up to the grace)."""
        fleet: FleetConfig = worker.app.batchfleet_config
        self._end(fleet.worker.shutdown_grace_s, BatchLoop.stop)

    def terminate(self, worker: Any) -> None:
        """Cold shutdown (SIGQUIT, or Celery's ``WorkerTerminate``): every loop hands what it
        holds and runs back to the fleet at once, steps in flight not waited for. Celery's
        ``StartStopStep.terminate`` would do nothing here: this step has no ``obj``."""
        self._end(TERMINATE_JOIN_S, BatchLoop.terminate)

    def _shutting_down(self, sender: Any = None, how: str = "", **_: Any) -> None:
        """Celery's ``worker_shutting_down`` (sent from its signal handler): a cold one cuts
        the loops short, also while a warm :meth:`stop` waits for them. Only flags are set."""
        if how == "Cold" and sender == self.hostname:
            for loop in self.loops:
                loop.terminate()

    def _end(self, wait_s: float, how: Callable[[BatchLoop], None]) -> None:
        self.health.draining()
        for loop in self.loops:
            how(loop)
        deadline = time.monotonic() + wait_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        signals.worker_shutting_down.disconnect(self._shutting_down)  # (a cold one came meanwhile)
        if self.health_server is not None:
            self.health_server.close()
            self.health_server = None

    def info(self, worker: Any) -> dict[str, Any]:
        models = {
            loop.model: {**loop.stats.snapshot(), **control.loop_info(loop)} for loop in self.loops
        }
        out: dict[str, Any] = {"batchfleet": models}
        # Flower's worker page lists each top-level key on a line: one readable line a model.
        out.update({f"batchfleet {m}": control.summary_line(info) for m, info in models.items()})
        metrics = getattr(worker, "_batchfleet_metrics", None)
        if metrics is not None:
            out["batchfleet_metrics_url"] = metrics.url
        return out


def create_app(
    config: FleetConfig | None = None, *, models: list[str] | None = None, burst: bool = False
) -> Celery:
    """A Celery app wired to the fleet's Redis, with the batch-loop step installed."""
    fleet = config or load_config()
    broker = fleet.celery_broker_url() or default_url()  # never a cluster: see FleetConfig
    app = Celery("batchfleet", broker=broker, set_as_current=True)
    app.conf.update(
        accept_content=["json", "msgpack"],
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        task_default_queue=CELERY_QUEUE,
        worker_send_task_events=True,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        # a webhooks worker killed mid-attempt: its delivery runs again within a minute or so
        broker_transport_options=fleet.webhooks.broker_transport_options(),
    )
    app.batchfleet_config = fleet
    app.batchfleet_models = models
    app.batchfleet_burst = burst
    # Factories (worker, fleet, model) -> LoopObserver: metrics, Flower events, webhooks.
    app.batchfleet_observers = [
        control.recent_rate,
        prometheus_metrics,
        flower_events,
        webhook_observer,
    ]
    webhook_tasks.register(app)  # run by `batchfleet webhooks worker`, on queue `webhooks`
    app.steps["worker"].add(BatchLoopStep)
    for name in fleet.models:
        # Registered so `inspect registered` and Flower know the batch task names.
        app.task(name=batch_task_name(name), shared=False)(_batch_placeholder)
    return app


def _batch_placeholder(*args: Any, **kwargs: Any) -> None:
    """Micro-batches are reported under this name; the task itself is never queued."""


def __getattr__(name: str) -> Any:
    # `celery -A batchfleet.worker.app` looks up `app`; build it from the environment then.
    if name == "app":
        built = create_app()
        globals()["app"] = built
        return built
    raise AttributeError(name)
