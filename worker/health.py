"""The worker's readiness and liveness over HTTP, for Kubernetes probes and load balancers.

``GET /readyz`` answers 200 once every model is loaded and its batch loop runs, and 503
while models load, from the moment the worker starts draining (SIGTERM), and while a
device hangs or is broken. ``GET /livez`` answers 200 while the process serves, unless a
batch loop thread has died, a model's device step has run longer than ``claim_idle_ms``
(a hung device: its requests already go to other workers; a restart frees the device),
or its runner raised in the last steps, two in a row or more (a broken one: its requests
were failed, ``worker/crashes.py``; a restart loads it again). The body
is a small JSON object with the reason. A stdlib ``http.server`` on a daemon thread: no
dependency, and it keeps answering while the model loads on the main thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)


class Health:
    """What the probes report: a phase set by the worker step, and its loop threads."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = self.STARTING
        self._detail = "loading models"
        self._threads: Sequence[threading.Thread] = ()
        self._hung: Mapping[str, Callable[[], float | None]] = {}
        self._broken: Mapping[str, Callable[[], int | None]] = {}

    def loading(self, model: str) -> None:
        with self._lock:
            self._detail = f"loading model {model}"

    def serving(
        self,
        threads: Sequence[threading.Thread],
        hung: Mapping[str, Callable[[], float | None]] | None = None,
        broken: Mapping[str, Callable[[], int | None]] | None = None,
    ) -> None:
        """Every loop is started: ready from now on. ``hung``: per model, how long its
        device step has hung (None: it has not; ``BatchLoop.hung_for``); ``broken``: the
        steps in a row its runner raised, once they take it for broken (None: they do
        not; ``BatchLoop.broken``)."""
        with self._lock:
            self._phase, self._detail, self._threads = self.SERVING, "", tuple(threads)
            self._hung = dict(hung or {})
            self._broken = dict(broken or {})

    def draining(self) -> None:
        """Shutdown began: unready, so no new work is routed here; still live."""
        with self._lock:
            self._phase, self._detail = self.DRAINING, "draining: finishing the running batch"

    def ready(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            dead = [t.name for t in self._threads if not t.is_alive()]
            hung = self._hung_devices()
            broken = self._broken_devices()
            ok = self._phase == self.SERVING and not dead and not hung and not broken
            detail = self._detail or (
                f"loop threads died: {dead}" if dead
                else f"devices hung: {hung}" if hung
                else f"devices broken (steps raised in a row): {broken}" if broken
                else "ok"
            )  # fmt: skip
            return ok, {"phase": self._phase, "detail": detail}

    def live(self) -> tuple[bool, dict[str, Any]]:
        with self._lock:
            dead = [t.name for t in self._threads if not t.is_alive()]
            hung = self._hung_devices()
            broken = self._broken_devices()
            # A loop thread ends only on shutdown; one gone while serving is a wedged worker.
            ok = not (self._phase == self.SERVING and dead) and not hung and not broken
            return ok, {"phase": self._phase, "dead_loops": dead, "hung_devices": hung,
                        "broken_devices": broken}  # fmt: skip

    def _hung_devices(self) -> dict[str, float]:
        """Models whose device step hangs, with the seconds it has run."""
        out: dict[str, float] = {}
        for model, hung_for in self._hung.items():
            ran = hung_for()
            if ran is not None:
                out[model] = round(ran, 1)
        return out

    def _broken_devices(self) -> dict[str, int]:
        """Models whose runner is taken for broken, with the steps it raised in a row."""
        return {m: n for m, broken in self._broken.items() if (n := broken()) is not None}


def _handler_for(health: Health) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[bool, dict[str, Any]]]] = {
        "/readyz": health.ready,
        "/livez": health.live,
        "/healthz": health.live,
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            probe = routes.get(self.path.split("?", 1)[0])
            if probe is None:
                self.send_error(404, "try /readyz or /livez")
                return
            ok, body = probe()
            data = json.dumps({"ok": ok, **body}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("health %s", format % args)

    return Handler


class HealthServer:
    """Serves a :class:`Health` on ``host:port`` from a daemon thread until ``close``."""

    def __init__(self, health: Health, host: str, port: int) -> None:
        self.health = health
        self._server = ThreadingHTTPServer((host, port), _handler_for(health))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        logger.info("health endpoint on port %d (/readyz, /livez)", self.port)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
