"""Control broadcasts from the gateway (its LoRA and development routes): the fleet's wait
(:mod:`batchfleet.control_wait`: every live worker of the models concerned, until each
replied or no reply came for ``--control-timeout``) off the event loop, and its outcome
as the routes' errors (503 where the broker fails, 504 where workers did not reply in
time, named in ``missing_workers``, 500 where some did it and some refused).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ...connection import AsyncClient
from ...control_wait import (
    DEFAULT_TIMEOUT_S,
    Replies,
    Send,
    as_text,
    broadcast,
    live_among,
    own_windows,
    window_ms,
)
from ...remote import send_to_all
from ...schemas.keys import ModelKeys
from ...schemas.model_info import WorkerServing, decode_worker_serving
from .errors import ApiError


def late(replies: Replies, done: str) -> ApiError:
    """The 504 where workers did not reply in time (``done``: what the others did)."""
    return ApiError(504, f"{done}; {replies.late_note()} (busy, or stopped without a "
                         "heartbeat yet): they may still do it",
                    code="timeout", extra={"missing_workers": list(replies.missing)})  # fmt: skip


def partial(replies: Replies, message: str) -> ApiError:
    """The 500 where some workers did it and some refused (the missing ones named)."""
    if replies.missing:
        message += f"; {replies.late_note()}"
    return ApiError(500, message, code="partially_applied",
                    extra={"missing_workers": list(replies.missing)})  # fmt: skip


async def live_workers(
    client: AsyncClient, models: Iterable[str], given_ms: int | None = None
) -> list[str]:
    """The consumer names of the workers of ``models`` whose last heartbeat is recent
    (:func:`~batchfleet.control_wait.live_among`; each worker's own window, unless
    ``given_ms``, else its model's: :func:`~batchfleet.control_wait.window_ms`), sorted."""
    live, _ = await _live(client, list(models), given_ms)
    return live


async def live_serving(client: AsyncClient, model: str) -> dict[str, WorkerServing | None]:
    """``model``'s live workers (as :func:`live_workers`), each with what it serves the
    model with (``bf:{model}:serving``; None: a worker older than it)."""
    live, (serving,) = await _live(client, [model], None)
    cards = {as_text(k): decode_worker_serving(v) for k, v in serving.items()}
    return {name: cards.get(name) for name in live}


async def _live(
    client: AsyncClient, models: list[str], given_ms: int | None
) -> tuple[list[str], list[dict[Any, Any]]]:
    """The live workers of ``models``, and each model's serving hash as read."""
    keys = [ModelKeys(m) for m in models]
    now = await client.time()
    beats = await asyncio.gather(*(client.hgetall(k.workers) for k in keys))
    published = await asyncio.gather(*(client.get(k.heartbeat_timeout) for k in keys))
    serving = await asyncio.gather(*(client.hgetall(k.serving) for k in keys))
    own = [own_windows(s) if given_ms is None else {} for s in serving]
    return live_among(now, beats, [window_ms(p, given_ms) for p in published], own), serving


@dataclass(frozen=True, slots=True)
class ControlAdmin:
    """The fleet's broker (where workers listen for broadcasts), how long replies are
    awaited, and how recent a heartbeat must be for its worker to be waited for (None:
    what the workers published, :func:`~batchfleet.control_wait.window_ms`)."""

    broker_url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    send: Send = send_to_all
    heartbeat_window_ms: int | None = None

    async def live(self, client: AsyncClient, models: Iterable[str]) -> list[str]:
        """The live workers of ``models``, as :func:`live_workers` with this window."""
        return await live_workers(client, models, self.heartbeat_window_ms)

    async def broadcast(
        self, command: str, arguments: dict[str, Any], expect: Sequence[str]
    ) -> Replies:
        """Broadcast ``command``, waiting for the workers of ``expect`` (off the event loop:
        it blocks); none expected: nothing is sent. A 503 where the broker cannot be
        reached or refuses (its ACL user)."""
        try:
            return await asyncio.to_thread(broadcast, self.broker_url, command, arguments,
                                           expect, timeout=self.timeout_s, send=self.send)  # fmt: skip
        except Exception as exc:  # kombu's and redis' errors alike: the broker's side
            raise ApiError(503, f"the broker failed: {type(exc).__name__}: {exc}",
                           code="unavailable") from None  # fmt: skip
