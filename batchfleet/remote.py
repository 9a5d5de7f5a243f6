"""Talking to running workers from outside (CLI, scripts, Flower): broadcasts and inspect.

Torch-free: a bare Celery client app on the fleet's broker, never the worker's app, so
``batchfleet pause`` starts in well under a second, and ``celery -A batchfleet.remote
flower`` (what ``batchfleet flower`` runs) does not load torch. The control commands
themselves (``bf_pause`` …) are defined in :mod:`batchfleet.worker.control`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from celery import Celery

from .connection import is_cluster_url
from .schemas.errors import ConfigError

SERIALIZERS: dict[str, Any] = {
    "accept_content": ["json", "msgpack"],
    "task_serializer": "json",
    "result_serializer": "json",
    "event_serializer": "json",
}
"""What the workers' app accepts and sends (see ``batchfleet.worker.app.create_app``)."""


@contextlib.contextmanager
def client_app(broker_url: str, name: str = "batchfleet-client") -> Iterator[Celery]:
    """A Celery app on the fleet's broker for broadcasts, inspect and ``send_task``. A Redis
    Cluster URL is refused (:class:`~batchfleet.schemas.errors.ConfigError`): kombu knows
    no such transport and would talk to ``localhost:6379`` instead."""
    if is_cluster_url(broker_url):
        raise ConfigError(
            "the broker cannot be a Redis Cluster (Celery's transport needs "
            "one node): give the fleet's broker_url, a plain redis:// URL"
        )
    app = Celery(name, broker=broker_url, set_as_current=False)
    app.conf.update(SERIALIZERS)
    try:
        yield app
    finally:
        app.close()


class _AllReplied(Exception):
    """Every worker waited for replied: ends the collection of replies early."""


def replied_as(host: str, reply: Any, names: Collection[str]) -> str | None:
    """Which of ``names`` (consumer names, as a model's heartbeats list them) the reply of
    Celery worker ``host`` is from: its reply's ``consumer`` where it has one (exactly:
    a worker's consumer name need not be its hostname's, under plain ``celery worker -n``),
    else (a worker older than that field) its hostname, or the name before its ``@``;
    None: none of them."""
    consumer = reply.get("consumer") if isinstance(reply, dict) else None
    if isinstance(consumer, str):
        return consumer if consumer in names else None
    for name in (host, host.split("@", 1)[0]):
        if name in names:
            return name
    return None


def send_to_all(
    broker_url: str,
    command: str,
    arguments: dict[str, Any] | None = None,
    *,
    timeout: float = 30.0,
    expect: Collection[str] = (),
    destination: Sequence[str] = (),
) -> dict[str, Any]:
    """Broadcast a control command to every worker (or those ``destination`` names:
    :func:`destination_pattern`); return hostname → reply once each worker of ``expect``
    (consumer names: :func:`replied_as`) replied, else once no reply came for ``timeout``
    seconds. Celery's ``limit`` ends the wait after that many replies, but from anyone:
    workers of other models, and other Celery workers on the broker, reply too, so the wait
    here ends by name. None is sent to a ping's answerers only: a worker too busy to answer
    a ping in time would not get the command at all."""
    got: dict[str, Any] = {}
    waiting = set(expect)

    def collect(body: dict[str, Any]) -> None:
        for host, reply in body.items():
            got[host] = reply
            waiting.discard(replied_as(host, reply, waiting) or "")
        if expect and not waiting:
            raise _AllReplied  # out of kombu's loop: its reply queue is dropped after

    where = {"pattern": destination_pattern(destination), "matcher": "pcre"} if destination else {}
    with client_app(broker_url, "batchfleet-control") as app, contextlib.suppress(_AllReplied):
        app.control.broadcast(command, arguments=arguments or {}, reply=True,
                              timeout=timeout, callback=collect, **where)  # fmt: skip
    return got


def destination_pattern(names: Sequence[str]) -> str:
    """The Celery hostnames ``names`` stand for, as a regular expression (kombu's ``pcre``
    matcher, which each worker applies to its own hostname): a name with ``@`` is one
    hostname; a bare worker name (``--name``, as ``batchfleet status`` shows it) is that
    name on every host. No ping resolves them first, so a busy worker still gets it."""
    alternatives = [re.escape(n) + ("" if "@" in n else "(?:@.*)?") for n in names]
    return f"(?:{'|'.join(alternatives)})\\Z"


def inspect_stats(broker_url: str, timeout: float = 1.0) -> dict[str, dict[str, Any]]:
    """``celery inspect stats`` of every batchfleet worker answering within ``timeout``:
    hostname → its ``batchfleet`` section (model → info)."""
    with client_app(broker_url, "batchfleet-status") as app:
        replies = app.control.inspect(timeout=timeout).stats() or {}
    return {host: info["batchfleet"] for host, info in replies.items() if "batchfleet" in info}


def parse_settings(items: Sequence[str]) -> dict[str, Any]:
    """``["max_batch_size=8", "lane_weights=4,2,1"]`` → values parsed as JSON where they can."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = [float(x) for x in raw.split(",")] if "," in raw else raw
        if key in ("lane_weights", "preferred_batch_sizes") and not isinstance(value, list):
            value = [value]
        out[key.strip()] = value
    return out


def __getattr__(name: str) -> Any:
    # `celery -A batchfleet.remote flower` looks up `app`: the fleet's broker, from the
    # environment (BATCHFLEET_CONFIG, REDIS_URL, BATCHFLEET_BROKER_URL) as workers read it.
    if name == "app":
        from .config import load_config

        built = Celery("batchfleet", broker=load_config().celery_broker_url(), set_as_current=False)
        built.conf.update(SERIALIZERS)
        globals()["app"] = built
        return built
    raise AttributeError(name)
