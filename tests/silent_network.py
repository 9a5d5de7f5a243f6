"""A hung network in front of a real Redis: a TCP proxy that forwards both ways until
:meth:`SilentProxy.silence`, then accepts and reads on every connection and delivers
nothing (a partition: neither refused nor reset, as a blackholed route behaves) until
:meth:`SilentProxy.heal`, when what it held goes through."""

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
        pumps = {asyncio.ensure_future(self._pump(reader, up_writer)),
                 asyncio.ensure_future(self._pump(up_reader, writer))}  # fmt: skip
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # (a side closed)
        finally:
            for pump in pumps:
                pump.cancel()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as it comes; pass on only while flowing (else held: read on, sent later)."""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
