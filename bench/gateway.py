"""What the OpenAI-compatible gateway costs: the same generation requests sent through it
(the `openai` client, streamed and whole) and straight through the Python producer.

``python -m bench.gateway`` starts its own Redis, one ``text-generation`` worker (the
generation benchmark's random 4-layer Llama) and one ``batchfleet gateway``, then runs
rounds of alternating arms, each a closed loop of ``--concurrency`` clients sending
``--requests`` chats of ``--max-tokens`` tokens (greedy, ``ignore_eos``: every request
generates them all):

- ``producer``: ``AsyncProducer.submit(stream=True)`` and ``job.deltas()``;
- ``gateway``: ``AsyncOpenAI().chat.completions.create(stream=True)``;
- ``producer whole`` / ``gateway whole``: the same without streaming (the producer
  waits with ``results()``, its reply-channel listener).

Per arm: output tokens/s over the arm, time to first token (streamed arms) or latency
(whole) p50 / p99, and the gateway process's CPU seconds per 1,000 tokens. Everything
shares the machine's cores (worker, Redis, gateway, this harness), so a gateway that
costs CPU shows as fewer tokens/s.

Then the cost of waiting: ``--waiting`` requests to a model no worker serves, held open
for ``--wait-s`` seconds, through the gateway (one reply-channel subscription for all)
and through ``job.result()`` (each polls its result key up to every 25 ms): Redis
commands per second while they wait (``INFO stats``).

Writes ``bench/results/gateway-<date>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from bench.generation import ROOT, tiny_llama

MODEL = "tiny-llama"
IDLE = "idle-model"
KEY = "sk-bench"
PROMPTS = ["tell me about the sea", "the cat sat on the mat and", "once upon a time there was",
           "a short story about a dog", "what is the weather like in", "write a line about"]  # fmt: skip


@dataclass
class Arm:
    name: str
    tokens: int = 0
    span_s: float = 0.0
    first_ms: list[float] = field(default_factory=list)
    """Streamed: submit → first text; whole: submit → answer."""
    gateway_cpu_s: float = 0.0

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.span_s if self.span_s else 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def run_arm(name: str, url: str, base: str, args: argparse.Namespace, gw_pid: int) -> Arm:
    import openai
    from batchfleet.producer.aio import AsyncProducer

    arm = Arm(name)
    stream = "whole" not in name
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300)
    async with AsyncProducer(url, default_priority=0) as producer:

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} {i}"}]
            t0 = time.perf_counter()
            first = None
            if name.startswith("producer"):
                job = await producer.submit(MODEL, messages=messages, max_new_tokens=args.max_tokens,
                                            ignore_eos=True, stream=stream)  # fmt: skip
                if stream:
                    async for d in job.deltas(timeout=300):
                        if first is None and getattr(d, "text", ""):
                            first = time.perf_counter()
                    res = await job.result(timeout=300)
                else:
                    (res,) = [r async for r in producer.results([job], timeout=300)]
                tokens = res.usage.completion_tokens if res.usage else 0
            else:
                ask: dict[str, Any] = {"model": MODEL, "messages": messages,
                                       "max_tokens": args.max_tokens,
                                       "extra_body": {"ignore_eos": True, "priority": 0}}  # fmt: skip
                if stream:
                    tokens = 0
                    chunks = await client.chat.completions.create(
                        **ask, stream=True, stream_options={"include_usage": True}
                    )
                    async for c in chunks:
                        if first is None and c.choices and c.choices[0].delta.content:
                            first = time.perf_counter()
                        if c.usage is not None:
                            tokens = c.usage.completion_tokens
                else:
                    reply = await client.chat.completions.create(**ask)
                    tokens = reply.usage.completion_tokens if reply.usage else 0
            end = time.perf_counter()
            arm.tokens += tokens
            arm.first_ms.append(((first or end) - t0) * 1e3)

        async def worker() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        cpu0, t0 = cpu_s(gw_pid), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        arm.span_s = time.perf_counter() - t0
        arm.gateway_cpu_s = cpu_s(gw_pid) - cpu0
    await client.close()
    return arm


async def waiting_cost(url: str, base: str, n: int, wait_s: float, how: str) -> float:
    """Redis commands/s while ``n`` requests wait for a model no worker serves."""
    import openai
    from batchfleet.producer.aio import AsyncProducer

    r = redis.Redis.from_url(url)
    r.set(f"bf:{{{IDLE}}}:lanes", 3)
    tasks: list[asyncio.Task[Any]] = []
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=600)
    async with AsyncProducer(url) as producer:
        if how == "gateway":
            for i in range(n):
                tasks.append(asyncio.ensure_future(client.completions.create(
                    model=IDLE, prompt=f"p{i}", max_tokens=4)))  # fmt: skip
        else:
            jobs = [await producer.submit(IDLE, inputs=f"p{i}", max_new_tokens=4) for i in range(n)]
            tasks = [asyncio.ensure_future(j.result(timeout=600)) for j in jobs]
        await asyncio.sleep(2.0)  # all submitted and waiting
        before = int(r.info("stats")["total_commands_processed"])
        await asyncio.sleep(wait_s)
        after = int(r.info("stats")["total_commands_processed"])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    r.delete(f"bf:{{{IDLE}}}:lane:0", f"bf:{{{IDLE}}}:lane:1", f"bf:{{{IDLE}}}:lane:2")
    r.close()
    return (after - before) / wait_s


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--waiting", type=int, default=300)
    p.add_argument("--wait-s", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)

    from batchfleet.redis_server import LocalRedis, free_port

    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    lm = tiny_llama(work)
    server = LocalRedis()
    url = server.start()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    fleet = work / "fleet.toml"
    fleet.write_text(
        f'redis_url = "{url}"\n[worker]\nblock_ms = 100\n[models.{MODEL}]\n'
        f'runner = "text-generation"\npath = "{lm}"\nmax_tokens = 1024\n'
        f"[models.{MODEL}.options]\nkv_cache_tokens = 16384\nmax_running = 32\n"
        "step_tokens = 512\n"
    )
    worker = start([sys.executable, "-m", "batchfleet", "worker", "--config", str(fleet),
                    "--name", "bench-gw-worker", "--loglevel", "WARNING"], work / "worker.log", env)  # fmt: skip
    port = free_port()
    gateway = start([sys.executable, "-m", "batchfleet", "gateway", "--redis-url", url,
                     "--port", str(port), "--api-key", KEY], work / "gateway.log", env)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    r = redis.Redis.from_url(url)
    try:
        end = time.monotonic() + 300
        while not r.hexists(f"bf:{{{MODEL}}}:workers", "bench-gw-worker"):
            if worker.poll() is not None or time.monotonic() > end:
                raise RuntimeError((work / "worker.log").read_text()[-3000:])
            time.sleep(0.2)
        arms: list[Arm] = []
        names = ["producer", "gateway", "producer whole", "gateway whole"]
        asyncio.run(run_arm("producer", url, base, argparse.Namespace(
            requests=8, concurrency=4, max_tokens=8), gateway.pid))  # warm-up  # fmt: skip
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                arm = asyncio.run(run_arm(name, url, base, args, gateway.pid))
                arms.append(arm)
                print(f"{name}: {arm.tokens_s:.0f} tokens/s, first/latency p50 "
                      f"{pct(arm.first_ms, 0.5):.1f} ms, gateway CPU {arm.gateway_cpu_s:.2f} s",
                      flush=True)  # fmt: skip
        waits = {how: asyncio.run(waiting_cost(url, base, args.waiting, args.wait_s, how))
                 for how in ("gateway", "polling")}  # fmt: skip
        print(f"waiting: {waits}", flush=True)
    finally:
        for proc in (gateway, worker):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        r.close()
        server.stop()
    report = write_report(args, arms, waits)
    print(f"report: {report}")
    return 0


def write_report(args: argparse.Namespace, arms: list[Arm], waits: dict[str, float]) -> Path:
    lines = [
        f"# Gateway benchmark ({datetime.now():%Y-%m-%d %H:%M})", "",
        f"`python -m bench.gateway --requests {args.requests} --concurrency {args.concurrency} "
        f"--max-tokens {args.max_tokens} --rounds {args.rounds}`: a random 4-layer Llama "
        "(hidden 256), one worker, one gateway, this harness, Redis: all on this machine's "
        f"{os.cpu_count()} cores. Arms alternate within each round.", "",
        "| arm | tokens/s | TTFT (streamed) or latency (whole) p50 / p99 ms | gateway CPU s "
        "per 1,000 tokens |", "| --- | --- | --- | --- |",
    ]  # fmt: skip
    for a in arms:
        per = a.gateway_cpu_s / max(1, a.tokens) * 1000
        lines.append(f"| {a.name} | {a.tokens_s:,.0f} | {pct(a.first_ms, 0.5):.1f} / "
                     f"{pct(a.first_ms, 0.99):.1f} | {per:.3f} |")  # fmt: skip
    lines += ["", "Means over the rounds, gateway against producer:", ""]
    for kind in ("", " whole"):
        g = [a.tokens_s for a in arms if a.name == f"gateway{kind}"]
        pr = [a.tokens_s for a in arms if a.name == f"producer{kind}"]
        if g and pr:
            lines.append(f"- {('streamed' if not kind else 'whole')}: "
                         f"{statistics.mean(g) / statistics.mean(pr):.1%} of the producer's "
                         "tokens/s")  # fmt: skip
    lines += [
        "", f"Waiting: {args.waiting} requests held {args.wait_s:.0f} s for a model no worker "
        "serves; Redis commands/s while they wait:", "",
        f"- through the gateway (one reply-channel subscription): {waits['gateway']:,.0f}",
        f"- each `job.result()` polling its key: {waits['polling']:,.0f}", "",
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"gateway-{datetime.now():%Y-%m-%d-%H%M}.md"
    out.write_text("\n".join(lines))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
