"""Control broadcasts from the gateway (its LoRA and development routes): a Celery broadcast
to every worker on the fleet's broker, waiting for the workers of the models concerned,
those whose heartbeat (``bf:{model}:workers``) is recent, until each replied or no reply
came for the control timeout (``--control-timeout``). A busy worker that answers late is
waited for (nothing ends the wait but its reply or the timeout), and one that does not
answer in time is named (``missing_workers``), never taken for one that does not serve
the model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...connection import AsyncClient
from ...remote import replied_as, send_to_all
from ...schemas.keys import ModelKeys
from .errors import ApiError

DEFAULT_TIMEOUT_S = 30.0
"""How long the workers' replies are awaited (reading an adapter takes a while)."""
HEARTBEAT_WINDOW_MS = 6000
"""A worker whose last heartbeat is this recent is waited for (the fleet's default
``heartbeat_timeout_ms``: past it, the fleet takes the worker for dead)."""

Send = Callable[..., dict[str, Any]]
""":func:`~batchfleet.remote.send_to_all`'s signature: broker, command, arguments,
``timeout`` and ``expect``."""


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

    def late(self, done: str) -> ApiError:
        """The 504 where workers did not reply in time (``done``: what the others did)."""
        names = ", ".join(self.missing)
        return ApiError(504, f"{done}; {names} did not reply within {self.waited_s:g} s (busy, "
                             "or stopped without a heartbeat yet): they may still do it",
                        code="timeout", extra={"missing_workers": list(self.missing)})  # fmt: skip

    def partial(self, message: str) -> ApiError:
        """The 500 where some workers did it and some refused (the missing ones named)."""
        if self.missing:
            message += f"; {', '.join(self.missing)} did not reply within {self.waited_s:g} s"
        return ApiError(500, message, code="partially_applied",
                        extra={"missing_workers": list(self.missing)})  # fmt: skip


async def live_workers(client: AsyncClient, models: Iterable[str]) -> list[str]:
    """The consumer names of the workers of ``models`` whose last heartbeat is within
    :data:`HEARTBEAT_WINDOW_MS` of the Redis server's clock, sorted."""
    seconds, micros = await client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    beats = await asyncio.gather(*(client.hgetall(ModelKeys(m).workers) for m in models))
    return sorted({(k.decode() if isinstance(k, bytes) else str(k))
                   for hearts in beats for k, v in hearts.items()
                   if now_ms - int(v) <= HEARTBEAT_WINDOW_MS})  # fmt: skip


@dataclass(frozen=True, slots=True)
class ControlAdmin:
    """The fleet's broker (where workers listen for broadcasts) and how long replies are
    awaited."""

    broker_url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    send: Send = send_to_all

    async def broadcast(
        self, command: str, arguments: dict[str, Any], expect: Sequence[str]
    ) -> Replies:
        """Broadcast ``command``, waiting for the workers of ``expect`` (off the event loop:
        it blocks); none expected: nothing is sent. A 503 where the broker cannot be
        reached or refuses (its ACL user)."""
        if not expect:
            return Replies({}, waited_s=self.timeout_s)
        try:
            got = await asyncio.to_thread(self.send, self.broker_url, command, arguments,
                                          timeout=self.timeout_s, expect=expect)  # fmt: skip
        except Exception as exc:  # kombu's and redis' errors alike: the broker's side
            raise ApiError(503, f"the broker failed: {type(exc).__name__}: {exc}",
                           code="unavailable") from None  # fmt: skip
        answered = {replied_as(host, reply, expect) for host, reply in got.items()}
        missing = tuple(n for n in expect if n not in answered)
        return Replies(got, tuple(expect), missing, self.timeout_s)
