"""How a control broadcast waits for the fleet (the CLI's control commands and the
gateway's LoRA and development routes alike): for each live worker of the models
concerned, those whose heartbeat (``bf:{model}:workers``) is recent, until each replied or
no reply came for the timeout. A busy worker that answers late is waited for (nothing
ends the wait but its reply or the timeout), and one that does not answer in time is
named (:attr:`Replies.missing`), never taken for one that does not serve the model.

Torch-free, and free of the gateway's and the CLI's own code: both import it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .connection import SyncClient, execute_timed, timed_pipeline
from .remote import replied_as, send_to_all
from .schemas.keys import ModelKeys
from .schemas.model_info import decode_worker_serving

DEFAULT_TIMEOUT_S = 30.0
"""How long the workers' replies are awaited (reading an adapter takes a while)."""
HEARTBEAT_WINDOW_MS = 6000
"""A worker whose last heartbeat is this recent is waited for, where its model's workers
published no ``heartbeat_timeout_ms`` (older workers) and none is given: the fleet's
default (past it, the fleet takes the worker for dead)."""

Send = Callable[..., dict[str, Any]]
""":func:`~batchfleet.remote.send_to_all`'s signature: broker, command, arguments,
``timeout``, ``expect`` (and ``destination``, where one is given)."""


@dataclass(frozen=True, slots=True)
class Replies:
    """What a broadcast got: hostname → reply, the live workers of the models concerned
    (``expected``, consumer names) and those of them that did not reply within
    ``waited_s``."""

    got: dict[str, Any]
    expected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    waited_s: float = DEFAULT_TIMEOUT_S

    def mine(self, serves: Callable[[Mapping[str, Any]], bool]) -> dict[str, Mapping[str, Any]]:
        """The replies of the workers concerned: those expected, and any other that
        ``serves`` the model (its heartbeat older than the window). Others' are left out
        (other models' workers, other Celery workers on the broker)."""
        return {h: r for h, r in self.got.items() if isinstance(r, Mapping)
                and (replied_as(h, r, self.expected) is not None or serves(r))}  # fmt: skip

    def late_note(self) -> str:
        """Who did not reply in time, in words ("" where none)."""
        if not self.missing:
            return ""
        return f"{', '.join(self.missing)} did not reply within {self.waited_s:g} s"


def window_ms(published: Any, given_ms: int | None = None) -> int:
    """How recent a heartbeat must be for its worker to be waited for: ``given_ms`` (the
    operator's ``--heartbeat-window``), else what the model's workers published (their
    fleet file's ``heartbeat_timeout_ms``: ``bf:{model}:heartbeat_timeout_ms``), else
    :data:`HEARTBEAT_WINDOW_MS`."""
    if given_ms is not None:
        return given_ms
    try:
        return max(1, int(published))
    except (TypeError, ValueError):  # none published (older workers), or not a number
        return HEARTBEAT_WINDOW_MS


def own_windows(serving: Mapping[Any, Any]) -> dict[str, int]:
    """Each worker's own heartbeat window, from a model's ``bf:{model}:serving`` hash
    (consumer name → ``WorkerServing`` JSON): workers of one model may run fleet-file
    entries with different ``heartbeat_timeout_ms``; one that published none is left out."""
    out: dict[str, int] = {}
    for name, raw in serving.items():
        card = decode_worker_serving(raw)
        if card is not None and card.heartbeat_timeout_ms is not None:
            out[as_text(name)] = card.heartbeat_timeout_ms
    return out


def live_among(
    redis_time: Sequence[Any],
    beats: Iterable[Mapping[Any, Any]],
    windows: Iterable[int] = (),
    own: Iterable[Mapping[str, int]] = (),
) -> list[str]:
    """The consumer names among ``beats`` (heartbeat hashes: name → unix ms, one a model)
    whose last heartbeat is within its window of ``redis_time`` (``TIME``'s reply), sorted:
    the worker's ``own`` (:func:`own_windows`, one mapping a model, in the same order), else
    its model's (``windows``, in the same order), else :data:`HEARTBEAT_WINDOW_MS`."""
    seconds, micros = redis_time
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    hearts = list(beats)
    limits = [*windows, *[HEARTBEAT_WINDOW_MS] * len(hearts)]
    mine = [*own, *[{}] * len(hearts)]
    return sorted({as_text(k) for h, limit, by in zip(hearts, limits, mine, strict=False)
                   for k, v in h.items() if now_ms - int(v) <= by.get(as_text(k), limit)})  # fmt: skip


def live_workers(
    client: SyncClient, models: Sequence[str], given_ms: int | None = None
) -> tuple[list[str], int]:
    """:func:`live_among` the heartbeats of ``models``, each worker's window its own as it
    published it (unless ``given_ms``), else its model's as :func:`window_ms` says, in one
    round trip (a Redis Cluster's ``TIME`` apart: :func:`~batchfleet.connection.timed_pipeline`);
    and the longest window applied (for a message). The gateway's
    asynchronous twin: :func:`batchfleet.producer.gateway.fleet_control.live_workers`."""
    pipe = timed_pipeline(client)
    for model in models:
        pipe.hgetall(ModelKeys(model).workers)
        pipe.get(ModelKeys(model).heartbeat_timeout)
        pipe.hgetall(ModelKeys(model).serving)
    now, replies = execute_timed(client, pipe)
    windows = [window_ms(p, given_ms) for p in replies[1::3]]
    own = [own_windows(s) if given_ms is None else {} for s in replies[2::3]]
    live = live_among(now, replies[0::3], windows, own)
    applied = [*windows, *(w for by in own for name, w in by.items() if name in live)]
    return live, max(applied, default=window_ms(None, given_ms))


def hostnames(client: SyncClient, models: Sequence[str]) -> dict[str, str]:
    """The Celery hostnames the workers of ``models`` published: consumer name → hostname
    (``bf:{model}:hostnames``; none from workers older than it)."""
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(ModelKeys(model).hostnames)
    return {as_text(k): as_text(v) for found in pipe.execute() for k, v in found.items()}


def addressed(
    live: Sequence[str], hosts: Mapping[str, str], destination: Sequence[str]
) -> tuple[list[str], list[str]]:
    """The live consumers ``destination`` names (each by its consumer name or its Celery
    hostname, ``hosts``), and the destination that reaches each of them: ``destination``
    with their hostnames (a worker named in its fleet file but started as ``celery worker
    -n OTHER``: its name does not match its hostname)."""
    chosen = [c for c in live if named(c, destination) or named(hosts.get(c, c), destination)]
    extra = [hosts[c] for c in chosen if c in hosts and hosts[c] not in destination]
    return chosen, [*destination, *extra]


def as_text(value: Any) -> str:
    """A Redis reply's bytes as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def named(consumer: str, destination: Collection[str]) -> bool:
    """Whether the worker of ``consumer`` (its ``--name``, or its Celery hostname where it
    has none) is one that ``destination`` names: a hostname (``NAME@HOST``) or a bare
    name, as :func:`~batchfleet.remote.send_to_all` matches them."""
    return any(consumer in (d, d.split("@", 1)[0]) or consumer.split("@", 1)[0] == d
               for d in destination)  # fmt: skip


def broadcast(
    broker_url: str,
    command: str,
    arguments: dict[str, Any],
    expect: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    destination: Sequence[str] = (),
    send: Send = send_to_all,
) -> Replies:
    """Broadcast ``command`` (to the workers ``destination`` names, else to all), waiting
    for the workers of ``expect``; none expected: nothing is sent. Blocks (the gateway
    calls it off its event loop); the broker's errors are raised."""
    if not expect:
        return Replies({}, waited_s=timeout)
    where = {"destination": list(destination)} if destination else {}
    got = send(broker_url, command, arguments, timeout=timeout, expect=expect, **where)
    answered = {replied_as(host, reply, expect) for host, reply in got.items()}
    missing = tuple(n for n in expect if n not in answered)
    return Replies(got, tuple(expect), missing, timeout)
