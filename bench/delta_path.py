"""``python -m bench.delta_path``: what each stage between a generation step's tokens and
their deltas at a subscriber costs, per step and per delta, in CPU time and Redis's own
counters (numbers a noisy, shared host leaves mostly alone, unlike wall times).

A real tiny-Llama runner (the generation benchmark's, same options) steps ``--rows``
streaming requests through ``--steps`` decode steps, all prefilled first; each step's
deltas go through the worker's own path (``DeltaWriter`` → ``TokenWrites``, as
``ResultSink.stream_now`` sends them) to a real Redis, and a subscriber thread reads the
messages with redis-py (its parser named in the output). Stages, each thread CPU
(``time.thread_time``) unless said:

- ``engine``: the engine's step (for scale);
- ``runner after engine``: the runner's work once the engine returns (rows into texts,
  detokenization, stop strings, events), and of it ``detokenize`` (``TextStream.extend``);
- ``post: deltas built``: ``DeltaWriter.post`` numbering the events into ``Streamed``
  items, without the write below;
- ``write: entries``, ``write: packed``, ``write: sent``: the items' entries as
  ``ResultSink.stream_now`` hands them over (the ``Streamed`` items themselves: a plain
  delta is packed without a ``TokenWrite``, ``Streamed.item``), the ``EVALSHA`` commands
  packed, the socket write;
- ``settle``: the report's progress filled in after the deltas;
- ``answer read``: reading Redis's reply (the next step's write or the sink does);
- ``redis tokens.lua``: ``INFO commandstats`` ``cmdstat_evalsha`` usec per call (Redis's
  time in the script, every XADD and PUBLISH of the step: a script's messages reach
  subscribers when it ends);
- ``subscriber read``: the subscriber thread's CPU per message received and parsed.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from batchfleet.redis_server import LocalRedis

OPTIONS: dict[str, Any] = {
    "engine": "padded", "kv_cache_tokens": 32768, "page_size": 32, "step_tokens": 512,
    "max_running": 64,
}  # fmt: skip
"""The generation benchmark's runner options (``bench/generation.py``'s defaults)."""
CHANNEL = "bench:deltas"


class Stages:
    """Thread CPU seconds per stage, summed over the measured steps, less what the stamps
    themselves cost (measured first: two ``thread_time`` calls and a wrapper, about a
    microsecond, as much as a short stage such as one row's detokenization)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self.cost = 0.0
        probe = self.wrap("probe", lambda: None)
        self.on = True
        n = 20_000
        for _ in range(n):
            probe()
        self.on = False
        self.cost = self.cpu.pop("probe") / n
        del self.calls["probe"]

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.thread_time()
        try:
            yield
        finally:
            if self.on:
                self.cpu[stage] += time.thread_time() - t0

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, its thread CPU counted (a stamp's own cost taken off, per call)."""
        clock = time.thread_time

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.cpu[stage] += clock() - t0 - self.cost
                    self.calls[stage] += 1

        return wrapped


def evalsha_stats(client: redis.Redis) -> tuple[int, int]:
    """``cmdstat_evalsha``'s calls and usec so far."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


class Subscriber:
    """Reads the deltas' channel on a thread of its own, counting its CPU per message."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(CHANNEL)
        self.pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        self.received = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="subscriber", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.is_set():
            if self.pubsub.get_message(timeout=0.2) is not None:
                self.received += 1
        self.cpu_s = time.thread_time() - t0

    def stop(self, expected: int, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while self.received < expected and time.monotonic() < end:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join()
        self.pubsub.close()


def run(url: str, workdir: Path, rows: int, steps: int, prompt_tokens: int) -> list[str]:
    """The measured steps; the report's lines."""
    import torch
    from batchfleet.schemas.messages import Request
    from batchfleet.worker.deltas import DeltaWriter, StreamTo
    from batchfleet.worker.generation import detok
    from batchfleet.worker.inbox import StepDone
    from batchfleet.worker.runner import Partial, StepReport, Work
    from batchfleet.worker.streams import ModelStreams
    from batchfleet.worker.token_writes import TokenWrites

    from .generation import WORDS, GenModel, load_runner, tiny_llama

    torch.set_num_threads(1)
    runner = load_runner(GenModel("tiny-llama", tiny_llama(workdir), OPTIONS))
    tok = runner.tokenizer
    client = redis.Redis.from_url(url)
    streams = ModelStreams(client, "bench", 3, "w1")
    writes = TokenWrites(streams)
    st = Stages()
    runner.engine.step = st.wrap("engine", runner.engine.step)
    extend = detok.TextStream.extend
    detok.TextStream.extend = st.wrap("detokenize", extend)  # type: ignore[method-assign]
    StepReport.settle = st.wrap("settle", StepReport.settle)  # type: ignore[method-assign]
    entries = st.wrap("write: entries", lambda items: items)  # (as stream_now: packed as they are)
    pack = st.wrap("write: packed", streams.tokens_commands)
    sent: list[Any] = []

    def send(commands: list[bytes]) -> None:
        with st.timed("write: sent"):
            writes._conn.send_packed_command(commands, check_health=False)
        sent.append(len(commands))

    def stream(items: Sequence[Any]) -> None:
        with st.timed("write"):
            send(pack(entries(items)))

    def answer() -> None:
        with st.timed("answer read"):
            for _ in range(sent.pop() if sent else 0):
                writes._conn.read_response()

    writes._conn = writes._pool.get_connection()  # type: ignore[union-attr]
    streams.load_tokens_script()
    writer = DeltaWriter(stream, lambda done: None)
    words = " ".join(WORDS[i % len(WORDS)] for i in range(prompt_tokens))
    prompt = tok.decode(tok(words)["input_ids"][:prompt_tokens])
    reqs = [Request(id=f"d{k}", model="bench", inputs=[prompt], max_new_tokens=steps + 64,
                    stream=True) for k in range(rows)]  # fmt: skip
    keys = [f"0-{k}" for k in range(rows)]
    writer.expect([StreamTo(key, f"d{k}", "bench", 600, CHANNEL, "msgpack")
                   for k, key in enumerate(keys)])  # fmt: skip
    admit = tuple(zip(keys, runner.prepare_many(reqs), strict=True))
    sub = Subscriber(url)
    sub.start()
    deltas = 0
    n = 0
    work = Work("s0", admit)
    before = (0, 0)
    runner_cpu = 0.0
    for n in range(steps + 64):
        if n == 64:
            answer()
            before = evalsha_stats(client)
            st.on = True
        t0 = time.thread_time()
        report = runner.step(work)
        if st.on:
            runner_cpu += time.thread_time() - t0
        answer()
        done = StepDone(f"s{n}", report, 0.0, 0.0)
        with st.timed("post"):
            writer.post(done)
        if st.on:
            deltas += sum(isinstance(ev, Partial) for ev in report.events)
        work = Work(f"s{n + 1}", ())
    answer()
    after = evalsha_stats(client)
    st.on = False
    sub.stop(deltas)
    writes.close()
    calls, usec = after[0] - before[0], after[1] - before[1]
    cpu = st.cpu
    measured_steps = steps
    # the stamped calls inside the runner's step (the engine's, each row's detokenization,
    # and the last report settled, once a step: here already) cost it their stamps too
    inside = (st.calls["engine"] + st.calls["detokenize"] + steps) * st.cost
    after_engine = runner_cpu - cpu["engine"] - inside
    write_parts = cpu["write: entries"] + cpu["write: packed"] + cpu["write: sent"]
    rows_out: list[tuple[str, float]] = [
        ("engine", cpu["engine"]),
        ("runner after engine (rows, texts, events)", after_engine),
        ("  of it: detokenize", cpu["detokenize"]),
        ("post: deltas built (numbering, Streamed)", cpu["post"] - cpu["write"] - cpu["settle"]),
        ("write: entries", cpu["write: entries"]),
        ("write: EVALSHA packed", cpu["write: packed"]),
        ("write: sent", cpu["write: sent"]),
        ("write: other", cpu["write"] - write_parts),
        ("answer read", cpu["answer read"]),
        ("settle (progress, after the deltas)", cpu["settle"]),
    ]
    per = max(deltas, 1)
    sub_per = sub.cpu_s / max(sub.received, 1)
    lines = [
        f"{rows} streaming rows, {measured_steps} decode steps measured, {deltas} deltas; "
        f"redis-py {redis.__version__}, parser {redis.connection.DefaultParser.__name__}; "
        f"a stamp's own cost, taken off: {st.cost * 1e6:.2f} µs",
        "",
        "| stage | µs per step | µs per delta |",
        "| --- | --- | --- |",
    ]
    for name, s in rows_out:
        lines.append(f"| {name} | {s / measured_steps * 1e6:.0f} | {s / per * 1e6:.2f} |")
    lines.append(f"| redis tokens.lua (commandstats, {calls} calls) | "
                 f"{usec / max(calls, 1):.0f} | {usec / per:.2f} |")  # fmt: skip
    lines.append(f"| subscriber read ({sub.received} messages) | "
                 f"{sub_per * deltas / measured_steps * 1e6:.0f} | {sub_per * 1e6:.2f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delta_path", description=__doc__)
    p.add_argument("--rows", type=int, default=32, help="streaming requests (default 32)")
    p.add_argument("--steps", type=int, default=128, help="decode steps measured")
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args(argv)
    with LocalRedis() as url, tempfile.TemporaryDirectory(prefix="bench-delta-") as tmp:
        print("\n".join(run(url, Path(tmp), args.rows, args.steps, args.prompt_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
