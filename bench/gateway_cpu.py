"""The gateway's CPU per streamed token, per route, measured without a model.

``python -m bench.gateway_cpu`` starts its own Redis and the real gateway (``serve``) on
a thread of its own, and plays the worker itself: it takes ``--requests`` streamed
requests of one route from the lanes, then writes their deltas step by step as a worker
does (one ``tokens.lua`` call a step, each request's delta in its token stream and on its
reply channel), ``--tokens`` steps, and stores their results. The clients (raw HTTP,
this process's main thread) read every event; the next step is written once each client
has received the previous one, so every route gets one delta a request a step, whatever
the machine's load.

Reported per route (chat, completions, responses, Anthropic messages): the gateway
thread's CPU time (its own clock: the load of other processes and of this harness'
threads does not count) per token over the token steps, and per token over the whole
round (submissions and the last events included); the median over ``--rounds``.
``--profile`` runs one more round of each under cProfile (the gateway thread only) and
writes its top 30 functions by own time and by cumulative time to ``<out>/profile.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "cpu-bench"
KEY = "sk-bench"
CHAT = [{"role": "user", "content": "hi"}]
WORDS = [" the", " sea", ' "quoted"', " line\n", " café", " and", "\tx", " {json}"]
MARK = "~"
"""Ends every token's text: a client counts them to know which step it has seen."""


def body_of(route: str, tokens: int) -> tuple[str, dict[str, Any]]:
    """The path and body of one streamed request of ``route``."""
    if route == "chat":
        return "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": True,
                                        "max_tokens": tokens}  # fmt: skip
    if route == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True,
                                   "max_tokens": tokens}  # fmt: skip
    if route == "responses":
        return "/v1/responses", {"model": MODEL, "input": "hi", "stream": True,
                                 "max_output_tokens": tokens}  # fmt: skip
    return "/v1/messages", {"model": MODEL, "messages": CHAT, "stream": True,
                            "max_tokens": tokens}  # fmt: skip


ROUTES = ("chat", "completions", "responses", "messages")


class GatewayThread:
    """The gateway (``serve``) on its own thread and event loop, with that thread's CPU
    clock."""

    def __init__(self, url: str, port: int) -> None:
        self.url, self.port = url, port
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, name="gateway", daemon=True)

    def _main(self) -> None:
        from batchfleet.producer.gateway.app import serve

        async def go() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop, ready = asyncio.Event(), asyncio.Event()
            server = asyncio.ensure_future(serve(self.url, port=self.port, api_key=KEY,
                                                 timeout_s=60, ready=ready, stop=self.stop))  # fmt: skip
            await ready.wait()
            self.ready.set()
            await server

        asyncio.run(go())

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the gateway did not start")

    def cpu_s(self) -> float:
        assert self.thread.ident is not None
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the gateway's thread (and wait for it)."""
        assert self.loop is not None
        done = threading.Event()

        def run() -> None:
            fn()
            done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait(10)

    def close(self) -> None:
        if self.loop is not None and self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


class Client:
    """One streamed request over raw HTTP: counts the token marks it received."""

    def __init__(self, port: int, path: str, body: dict[str, Any], rid: str) -> None:
        data = json.dumps(body).encode()
        self.head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
                     f"Authorization: Bearer {KEY}\r\nX-Request-Id: {rid}\r\n"
                     "Content-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n").encode() + data  # fmt: skip
        self.port = port
        self.marks = 0
        self.raw = bytearray()

    async def run(self, seen: Callable[[], None]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(self.head)
        mark = MARK.encode()
        while piece := await reader.read(65536):
            self.marks += piece.count(mark)
            self.raw += piece
            seen()
        writer.close()


async def one_round(
    gw: GatewayThread, route: str, n: int, tokens: int, tag: str
) -> dict[str, float]:
    """``n`` streamed requests of ``route``, ``tokens`` steps each: the gateway's CPU
    seconds over the steps and over the whole round."""
    from batchfleet.schemas.codec import decode_entry, encode_result
    from batchfleet.schemas.messages import Result, Usage
    from batchfleet.worker.streams import Finish, ModelStreams
    from batchfleet.worker.token_stream import TokenWrite

    from batchfleet.connection import connect

    streams = ModelStreams(connect(gw.url), MODEL, 3, "w1")
    path, body = body_of(route, tokens)
    clients = [Client(gw.port, path, body, f"{tag}-{route}-{i}") for i in range(n)]
    need, step_done = 0, asyncio.Event()

    def seen() -> None:
        if all(c.marks >= need for c in clients):
            step_done.set()

    cpu0 = gw.cpu_s()
    tasks = [asyncio.ensure_future(c.run(seen)) for c in clients]
    taken: list[tuple[Any, str, str | None]] = []
    while len(taken) < n:
        entries = await asyncio.to_thread(streams.read, {0: n, 1: n, 2: n}, 10_000)
        for entry in entries:
            request, _ = decode_entry(entry.fields, MODEL)
            taken.append((entry, request.id, request.reply))
    await asyncio.sleep(0.05)  # every stream is subscribed (its id sent) before its deltas
    texts = [WORDS[k % len(WORDS)] + MARK for k in range(tokens)]
    cpu1 = gw.cpu_s()
    for k in range(tokens):
        need = k + 1
        step_done.clear()
        streams.append_tokens([TokenWrite(rid, k + 1, 60, texts[k], tokens=1, reply=reply,
                                          model=MODEL) for _, rid, reply in taken])  # fmt: skip
        seen()
        await asyncio.wait_for(step_done.wait(), 30)
    cpu2 = gw.cpu_s()
    streams.append_tokens([TokenWrite(rid, tokens + 1, 60) for _, rid, _ in taken])
    text = "".join(texts)
    usage = Usage(prompt_tokens=5, completion_tokens=tokens)
    streams.finish([Finish(entry, rid, encode_result(Result(
        id=rid, model=MODEL, status="ok", usage=usage,
        outputs=[{"text": text, "finish_reason": "length", "prompt_tokens": 5,
                  "completion_tokens": tokens}])), 60, reply)
        for entry, rid, reply in taken])  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    cpu3 = gw.cpu_s()
    for c in clients:
        if not c.raw.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{route}: {bytes(c.raw[:300])!r}")
    streams.client.close()
    return {"steps": cpu2 - cpu1, "whole": cpu3 - cpu0}


async def measure(args: argparse.Namespace) -> str:
    from batchfleet.worker.streams import ModelStreams

    from batchfleet.connection import connect
    from batchfleet.redis_server import LocalRedis, free_port

    lines: list[str] = []
    redis_server = LocalRedis()
    url = redis_server.start()
    gw = GatewayThread(url, free_port())
    try:
        ModelStreams(connect(url), MODEL, 3, "w1").ensure_groups()
        gw.start()
        tokens = args.requests * args.tokens
        await one_round(gw, "chat", 2, 4, "warm")
        per: dict[str, list[dict[str, float]]] = {r: [] for r in args.routes}
        for r in range(args.rounds):
            for route in args.routes:
                per[route].append(await one_round(gw, route, args.requests, args.tokens, f"r{r}"))
        lines.append(f"{args.requests} streams x {args.tokens} tokens, {args.rounds} rounds "
                     "(median); gateway thread CPU in microseconds per token")  # fmt: skip
        lines.append("")
        lines.append("| route | steps us/token | whole us/token | rounds (steps) |")
        lines.append("|---|---:|---:|---|")
        for route, rounds in per.items():
            steps = [1e6 * x["steps"] / tokens for x in rounds]
            whole = [1e6 * x["whole"] / tokens for x in rounds]
            lines.append(f"| {route} | {statistics.median(steps):.1f} | "
                         f"{statistics.median(whole):.1f} | "
                         f"{' '.join(f'{s:.1f}' for s in steps)} |")  # fmt: skip
        if args.profile:
            profile = cProfile.Profile(time.thread_time)  # CPU time: the waits do not count
            gw.call(profile.enable)
            for route in args.routes:
                await one_round(gw, route, args.requests, args.tokens, "prof")
            gw.call(profile.disable)
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile.txt").write_text(out.getvalue())
            stats.dump_stats(args.out / "profile.pstats")
            lines.append("")
            lines.append(f"profile: {args.out / 'profile.txt'}")
    finally:
        gw.close()
        redis_server.stop()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=200, help="tokens (steps) per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--profile", action="store_true", help="and a cProfile round")
    parser.add_argument("--out", type=Path, default=Path("/tmp/gateway-cpu"))
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args))
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
