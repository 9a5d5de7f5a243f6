"""The gateway in-process against a real Redis, with the test playing the worker: for what
a real worker cannot be made to do on cue (a part failing, a chosen usage, a user's ACL)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from batchfleet.schemas.codec import decode_entry, encode_result
from batchfleet.schemas.messages import Limits, Request, Result, Usage
from batchfleet.schemas.model_info import ModelInfo
from batchfleet.worker.streams import Entry, Finish, ModelStreams
from batchfleet.worker.token_stream import TokenWrite

from batchfleet.connection import SyncClient
from batchfleet.redis_server import free_port

GATEWAY_KEY = "sk-test"


def http_request(method: str, path: str, body: Any = None, key: str | None = GATEWAY_KEY) -> bytes:
    """An HTTP/1.0 request (the gateway closes the connection after answering)."""
    data = b"" if body is None else json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    head = f"{method} {path} HTTP/1.0\r\n{auth}Content-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


async def http(
    port: int, method: str, path: str, body: Any = None, key: str | None = GATEWAY_KEY
) -> tuple[int, bytes]:
    """One call to the gateway: the status and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_request(method, path, body, key))
    response = await reader.read()
    writer.close()
    status, _, rest = response.partition(b"\r\n")
    return int(status.split()[1]), rest.partition(b"\r\n\r\n")[2]


@contextlib.asynccontextmanager
async def gateway_in_process(url: str, **options: Any) -> AsyncIterator[int]:
    """``serve`` (as `batchfleet gateway` runs it, with ``options``) on a free port, once it
    is subscribed to its reply channel: the port."""
    from batchfleet.producer.gateway.app import serve

    port, ready = free_port(), asyncio.Event()
    server = asyncio.ensure_future(serve(url, port=port, api_key=GATEWAY_KEY, timeout_s=20,
                                         ready=ready, **options))  # fmt: skip
    try:
        await asyncio.wait_for(ready.wait(), 20)
        yield port
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


@dataclass(frozen=True, slots=True)
class Taken:
    """A request the test took from the lanes, as a worker would."""

    entry: Entry
    id: str
    reply: str | None
    request: Request
    """As the worker decodes it."""


class ScriptedWorker:
    """One model's worker side, step by step (blocking: call it through a thread)."""

    def __init__(
        self, client: SyncClient, model: str, limits: Limits | None = None, max_depth: int = 0,
        info: ModelInfo | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.streams = ModelStreams(client, model, 3, "w1")
        self.streams.ensure_groups(max_depth or None, limits, info)

    def take(self) -> Taken:
        """The next request (waits up to 10 s)."""
        (entry,) = self.streams.read({0: 1, 1: 1, 2: 1}, 10_000)
        request, _ = decode_entry(entry.fields, self.model)
        return Taken(entry, request.id, request.reply, request)

    def answer(self, taken: Taken, result: Result) -> None:
        finish = Finish(taken.entry, taken.id, encode_result(result), 60, taken.reply)
        assert self.streams.finish([finish]) == [True]

    def ok(self, taken: Taken, outputs: list[Any], usage: Usage | None = None) -> None:
        self.answer(taken, Result(id=taken.id, model=self.model, status="ok", outputs=outputs,
                                  usage=usage))  # fmt: skip

    def start(self, taken: Taken) -> None:
        """Admit it, as a worker marks it when its prefill begins (before any token); a
        live worker (its heartbeat now)."""
        self.beat()
        self.streams.mark_started([(taken.id, 60)])

    def beat(self, age_ms: int = 0) -> None:
        """Its heartbeat, ``age_ms`` ago by the Redis clock."""
        seconds, micros = self.streams.client.time()
        self.streams.heartbeat(seconds * 1000 + micros // 1000 - age_ms)

    def delta(self, taken: Taken, seq: int, text: str | None = None) -> None:
        """Its token stream's entry ``seq``: ``text`` (one token), or the end (None)."""
        write = (TokenWrite(taken.id, seq, 60, text, tokens=1, reply=taken.reply)
                 if text is not None else TokenWrite(taken.id, seq, 60))  # fmt: skip
        self.streams.append_tokens([write])

    def cancelled(self, taken: Taken) -> bool:
        return self.streams.cancelled([taken.id]) == [taken.id]


async def leave_mid_stream(port: int, fake: ScriptedWorker, body: dict[str, Any]) -> Taken | None:
    """Stream ``body``, close the connection once its first event arrived while ``fake``
    writes tokens: the request, once the gateway cancelled it in the fleet (None if it
    did not)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(http_request("POST", "/v1/chat/completions", body))
    taken = await asyncio.to_thread(fake.take)
    for seq in range(1, 200):
        await asyncio.to_thread(fake.delta, taken, seq, "x")
        if seq == 1:
            await reader.readuntil(b"data: ")
            writer.close()
        if await asyncio.to_thread(fake.cancelled, taken):
            return taken
        await asyncio.sleep(0.05)
    return None


def gateway_cli(monkeypatch: Any) -> Callable[..., dict[str, Any]]:
    """``batchfleet gateway ARGS`` run with ``serve`` replaced: each call gives the
    options the command line would serve with (``monkeypatch``: pytest's)."""
    from batchfleet.producer.gateway import app

    from batchfleet import cli

    served: list[dict[str, Any]] = []

    async def serve(url: str | None, **options: Any) -> None:
        served.append(options)

    monkeypatch.setattr(app, "serve", serve)

    def run(*args: str) -> dict[str, Any]:
        assert cli.main(["gateway", *args]) == 0
        return served[-1]

    return run
