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
- ``subscriber read``: the subscriber's CPU per message received and parsed (a process of
  its own reading as the generation benchmark's harness does: hiredis off the socket).

Then wall times per delta (``time.perf_counter``, one clock for both processes): the
runner's step returned → the subscriber's ``recv`` returned with the delta, and the
``tokens.lua`` call sent → the same. Unlike the CPU times, a loaded host moves them: compare
arms run one after the other, several times.
"""

from __future__ import annotations

import argparse
import tempfile
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


def _subscribe(url: str, ready: Any, stop: Any, out: Any) -> None:
    """The subscriber process: the harness's reader (hiredis off the socket, every message
    of one ``recv`` stamped with its return); sends back its CPU seconds and each delta's
    (id, seq, received)."""
    import msgpack

    from .systems import Subscriber as Raw

    raw = Raw(url, ["SUBSCRIBE", CHANNEL])
    ready.set()
    got: list[tuple[str, int, float]] = []
    t0 = time.process_time()
    while not stop.is_set():
        t, messages = raw.receive(0.2)
        for msg in messages:
            if msg[0] == b"message":
                body = msgpack.unpackb(msg[2])
                got.append((body["id"], body["seq"], t))
    out.send((time.process_time() - t0, got))
    raw.sock.close()


class Subscriber:
    """Reads the deltas' channel in a process of its own, as a client would (in this one
    it would wait for the device thread's GIL), counting its CPU per message."""

    def __init__(self, url: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._out, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_subscribe, args=(url, self._ready, self._stop, child),
                                 name="subscriber", daemon=True)  # fmt: skip
        self.received = 0
        self.got: list[tuple[str, int, float]] = []
        self.cpu_s = 0.0

    def start(self) -> None:
        self._proc.start()
        if not self._ready.wait(60):
            raise RuntimeError("the subscriber process did not start")

    def stop(self, expected: int, timeout: float = 10.0) -> None:
        time.sleep(0.5)  # the last messages read
        self._stop.set()
        if self._out.poll(timeout):
            self.cpu_s, self.got = self._out.recv()
        self._proc.join(5)
        self.received = len(self.got)


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
    streams.tokens_commands = st.wrap("write: packed", streams.tokens_commands)  # type: ignore[method-assign]
    writes._conn = writes._pool.get_connection()  # type: ignore[union-attr]
    streams.load_tokens_script()
    conn_send = writes._conn.send_packed_command
    cur = [0]  # the step being written
    first_sent: dict[int, float] = {}  # its call sent (perf_counter, just before)

    def send_packed(commands: list[bytes], check_health: bool = True) -> None:
        first_sent.setdefault(cur[0], time.perf_counter())
        with st.timed("write: sent"):
            conn_send(commands, check_health=check_health)

    writes._conn.send_packed_command = send_packed
    sent: list[Any] = []

    def stream(items: Sequence[Any]) -> None:
        with st.timed("write"):
            sent.append(writes.send(entries(items)))

    def answer() -> None:
        with st.timed("answer read"):
            if sent:
                writes.receive(sent.pop())

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
    returned: dict[int, float] = {}  # each step's runner.step returned (perf_counter)
    step_of: dict[tuple[str, int], int] = {}  # a measured delta's (id, seq) -> its step
    seqs: dict[str, int] = {}
    for n in range(steps + 64):
        if n == 64:
            answer()
            before = evalsha_stats(client)
            st.on = True
        t0 = time.thread_time()
        report = runner.step(work)
        returned[n] = time.perf_counter()
        if st.on:
            runner_cpu += time.thread_time() - t0
        answer()
        done = StepDone(f"s{n}", report, 0.0, 0.0)
        cur[0] = n
        with st.timed("post"):
            writer.post(done)
        for ev in report.events:
            if isinstance(ev, Partial):  # numbered as the writer numbers them
                seqs[ev.key] = seq = seqs.get(ev.key, 0) + 1
                if st.on:
                    deltas += 1
                    step_of[(f"d{ev.key[2:]}", seq)] = n
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
    wall: dict[str, list[float]] = {"step returned → received": [], "call sent → received": []}
    for rid, seq, t in sub.got:
        k = step_of.get((rid.decode() if isinstance(rid, bytes) else rid, seq))
        if k is not None:
            wall["step returned → received"].append(t - returned[k])
            wall["call sent → received"].append(t - first_sent[k])
    lines += ["", f"Wall times per delta, {len(wall['step returned → received'])} matched "
              "(noisy on a shared host: compare arms run together):",
              "", "| interval | p50 ms | p90 ms |", "| --- | --- | --- |"]  # fmt: skip
    for name, v in wall.items():
        v.sort()
        if v:
            lines.append(
                f"| {name} | {v[len(v) // 2] * 1e3:.3f} | {v[len(v) * 9 // 10] * 1e3:.3f} |"
            )
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
