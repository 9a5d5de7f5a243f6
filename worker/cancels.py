"""Client cancellations of a generating model's requests.

A client cancels request ``<id>`` by setting ``bf:{model}:cancel:<id>`` (any value, with a
TTL; docs/protocol.md). This thread polls those keys for the requests the loop holds or
runs — one ``MGET`` every :data:`POLL_S` while there are any — and posts a
:class:`~.inbox.Cancel` for each newly found one. The loop ends it with the next step (a
running request) or at once (a waiting one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection

import redis

from .inbox import Cancel, Event
from .streams import ModelStreams

logger = logging.getLogger(__name__)

POLL_S = 0.02
"""How often the cancel keys are read (a step of a small model takes about as long)."""


class CancelWatch:
    """Polls the cancel keys of the requests it is told to watch."""

    def __init__(
        self,
        streams: ModelStreams,
        post: Callable[[Event], None],
        *,
        every_s: float = POLL_S,
        name: str = "cancels",
    ) -> None:
        self.streams = streams
        self._post = post
        self._every = every_s
        self._ids: frozenset[str] = frozenset()
        self._posted: set[str] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, request_ids: Collection[str]) -> None:
        """The requests to watch from now on (replacing the last set)."""
        ids = frozenset(request_ids)
        with self._cond:
            if ids != self._ids:
                self._ids = ids
                self._posted &= ids
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                if not self._ids:
                    self._cond.wait()
                    continue
                ids = [i for i in self._ids if i not in self._posted]
            try:
                found = self.streams.cancelled(ids)
            except redis.RedisError as exc:
                logger.warning("reading cancel keys failed: %s", exc)
                found = []
            if found:
                with self._cond:
                    self._posted.update(found)
                self._post(Cancel(tuple(found)))
            with self._cond:
                if not self._stop:
                    self._cond.wait(self._every)
