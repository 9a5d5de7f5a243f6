"""Celery's control broadcast scripted: the replies that come, in order, to
:func:`batchfleet.remote.send_to_all` (no Celery worker, no clock)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from kombu.matcher import match

from batchfleet import remote


class Broker:
    """Celery's broadcast as ``send_to_all`` sees it: each reply handed to its callback
    in the order they come, until the callback stops the collection (or none is left:
    kombu's wait for the next one timed out). A reply comes only from a worker the
    broadcast reaches: where it names a ``pattern``, a worker whose hostname kombu's
    matcher finds in it, as each worker checks its own."""

    def __init__(self, replies: Sequence[dict[str, Any]]) -> None:
        self.replies = replies
        self.delivered = 0
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.control = self

    def broadcast(self, command: str, *, callback: Callable[[Any], None], **kw: Any) -> None:
        self.sent.append((command, kw))
        pattern, matcher = kw.get("pattern"), kw.get("matcher")
        for reply in self.replies:
            if pattern and not all(match(host, pattern, matcher) for host in reply):
                continue
            self.delivered += 1
            callback(reply)


def scripted_broker(monkeypatch: pytest.MonkeyPatch, *replies: dict[str, Any]) -> Broker:
    """A :class:`Broker` with ``replies`` in place of the broker ``remote`` connects to."""
    app = Broker(replies)

    @contextlib.contextmanager
    def client_app(url: str, name: str = "") -> Iterator[Broker]:
        yield app

    monkeypatch.setattr(remote, "client_app", client_app)
    return app
