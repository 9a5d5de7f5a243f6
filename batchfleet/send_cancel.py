"""Connections whose write keeps a cancellation.

redis-py's asyncio connection writes a command under ``asyncio.wait_for(drain(),
socket_timeout)``, and Python < 3.12's ``wait_for`` returns the inner result where it came
at the moment of the cancel: the drain of a small command is done at once, so a cancel
landing on the write was lost, and the command went on into its read. A token stream
cancelled 1 to 3 event-loop turns into its ``XREAD BLOCK 1000`` ended a second late (at
the next cancel check, :func:`.cancels.not_lost` around the command). Here the write raises
the cancel it swallowed, and the connection is closed first: the command was sent, and its
reply must not be read by the next command on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TypeVar, cast

from redis.asyncio.connection import AbstractConnection

from .cancels import counter


class _CancelSafeSend(AbstractConnection):
    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        count = counter()
        asked = count()
        await super().send_packed_command(command, check_health)
        if count() > asked:  # lost on the way (wait_for, Python < 3.12)
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError


C = TypeVar("C", bound=AbstractConnection)

_made: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def cancel_safe(connection_class: type[C]) -> type[C]:
    """``connection_class`` (plain, TLS, Unix socket), its write keeping a cancellation
    (one subclass made per class)."""
    if issubclass(connection_class, _CancelSafeSend):
        return connection_class
    made = _made.get(connection_class)
    if made is None:
        name = f"CancelSafe{connection_class.__name__}"
        made = _made[connection_class] = type(name, (_CancelSafeSend, connection_class), {})
    return cast("type[C]", made)
