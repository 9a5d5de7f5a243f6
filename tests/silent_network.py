"""A hung network in front of a real Redis: a TCP proxy that forwards both ways until
:meth:`SilentProxy.silence`, then accepts and reads on every connection and delivers
nothing (a partition: neither refused nor reset, as a blackholed route behaves) until
:meth:`SilentProxy.heal`, when what it held goes through. It can also lose one reply
(:meth:`SilentProxy.lose_reply`): the connection drops after Redis answered, Redis up."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


class SilentProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_port``, on an event loop of its own (a
    thread): usable from a test's own loop, or in front of a process."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._lose: tuple[bytes, bytes] | None = None
        self.lost = 0
        """Replies lost (:meth:`lose_reply`)."""
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port: int = self._call(self._start())

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def silence(self) -> None:
        """From now on nothing gets through, either way; new connections are accepted."""
        self._call(self._set(False))

    def heal(self) -> None:
        """What was held, and what comes, goes through again."""
        self._call(self._set(True))

    def lose_reply(self, command: bytes, marker: bytes) -> None:
        """The next reply that holds ``marker`` and answers a command ``command`` (the last
        one the client sent on that connection) is dropped with its connection: Redis ran
        the command, the client reads a closed connection."""
        self._lose = (command, marker)

    def close(self) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _set(self, flowing: bool) -> None:
        (self._flowing.set if flowing else self._flowing.clear)()

    async def _start(self) -> int:
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError, OSError):  # (closed; target gone)
            await self._forward(reader, writer)
        writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        sent = [b""]  # what the client sent last on this connection
        pumps = {asyncio.ensure_future(self._pump(reader, up_writer, sent)),
                 asyncio.ensure_future(self._pump(up_reader, writer, sent, reply=True))}  # fmt: skip
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # (a side closed)
        finally:
            for pump in pumps:
                pump.cancel()
            up_writer.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: list[bytes],
        reply: bool = False,
    ) -> None:  # fmt: skip
        """Read as it comes; pass on only while flowing (else held: read on, sent later).
        A reply :meth:`lose_reply` names ends the connection instead."""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                if not reply:
                    sent[0] = data
                elif self._lose and self._lose[0] in sent[0] and self._lose[1] in data:
                    self._lose = None
                    self.lost += 1
                    return  # (the connection closes: the reply never reaches the client)
                writer.write(data)
                await writer.drain()
