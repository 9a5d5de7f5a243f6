"""``python -m bench.gen_worker STAMPS -- <batchfleet worker args>``: a worker that stamps
when its tokens are produced, for the generation benchmark (``bench/generation.py``).

A delta carries no production time, so this process wraps two methods before starting
the ordinary ``batchfleet worker`` (same process, same code path otherwise):

- the engine's ``step`` (``PaddedEngine`` or ``PagedEngine``): the instant it returns is
  when the step's tokens exist (``produced``);
- ``TextGenerationRunner.step``: when it is called (``began``) and returns (``reported``;
  detokenized, events built); ``DeltaWriter.post`` writes, once the deltas are out, one
  line per step: ``began produced reported preempted running kv key key ...``
  (``preempted``: requests the step preempted; ``running``, ``kv``: sequences running
  and tokens in their KV cache after it),
  a key once per ``Partial`` event, in order, so the n-th time a key appears is the delta
  with ``seq`` n.

Beside it, ``STAMPS.hand`` gets one line per step of the hand-off that follows:
``reported posted sending packing sent direct``: ``DeltaWriter.post`` called, the sink's
``stream_now`` called (its deltas numbered), ``TokenWrites.send`` called (the last
answer read, the locks taken: packing, then the socket write), ``stream_now`` returned
(sent, or queued for the writer thread), ``direct`` 1 where it sent them itself (0:
queued; ``-``: no deltas), so the
harness's "runner step returned → received" splits into the worker's part before the
``tokens.lua`` call leaves and the rest (Redis, the subscriber).

Times are ``time.perf_counter()``: CLOCK_MONOTONIC on Linux, one clock for every process on
the host, so the harness compares them with its subscriber's receive times directly.
Lines are kept in memory and written by a daemon thread every 50 ms, off the device
thread's path. That thread also keeps ``STAMPS.threads`` current: one ``native_id name``
line per Python thread, so the harness can name the threads of ``/proc/<pid>/task``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any


def install(path: Path) -> None:
    from batchfleet.worker.deltas import DeltaWriter
    from batchfleet.worker.generation.padded import PaddedEngine
    from batchfleet.worker.generation.paged import PagedEngine
    from batchfleet.worker.runner import Partial, Preempted
    from batchfleet.worker.runners.generation import TextGenerationRunner
    from batchfleet.worker.sink import RedisSink
    from batchfleet.worker.token_writes import TokenWrites

    produced = [0.0]
    lines: list[str] = []
    stamps: dict[int, tuple[float, float, float]] = {}
    runner_step = TextGenerationRunner.step
    post = DeltaWriter.post
    stream_now = RedisSink.stream_now
    send = TokenWrites.send
    packing = [0.0]
    hand: list[str] = []
    sending: list[tuple[float, float, float, int]] = []  # this step's stream_now, as below

    def stamped(engine_step: Any) -> Any:
        def stamped_engine_step(self: Any) -> Any:
            out = engine_step(self)
            produced[0] = time.perf_counter()
            return out

        return stamped_engine_step

    def stamped_runner_step(self: TextGenerationRunner, work: Any) -> Any:
        began = time.perf_counter()
        report = runner_step(self, work)
        reported = time.perf_counter()
        stamps[id(report)] = (began, produced[0], reported)
        return report

    def stamped_send(self: TokenWrites, items: Any) -> Any:
        packing[0] = time.perf_counter()
        return send(self, items)

    def stamped_stream_now(self: RedisSink, items: Any) -> None:
        t0 = time.perf_counter()
        queued = self._tokens_queued
        packing[0] = 0.0
        stream_now(self, items)
        sending.append((t0, packing[0], time.perf_counter(), int(self._tokens_queued == queued)))

    def stamped_post(self: DeltaWriter, done: Any) -> None:
        """After the deltas are out and the report settled (its progress filled in)."""
        posted = time.perf_counter()
        sending.clear()
        post(self, done)
        report = done.report
        began, made, reported = stamps.pop(id(report), (0.0, 0.0, 0.0))
        if sending:
            t0, tp, t1, direct = sending[0]
            hand.append(f"{reported:.6f} {posted:.6f} {t0:.6f} {tp:.6f} {t1:.6f} {direct}\n")
        else:
            hand.append(f"{reported:.6f} {posted:.6f} - - - -\n")
        keys = " ".join(ev.key for ev in report.events if isinstance(ev, Partial))
        preempted = sum(1 for ev in report.events if isinstance(ev, Preempted))
        running = sum(len(p.contexts) for p in report.progress.values())
        kv = sum(sum(p.contexts) for p in report.progress.values())
        lines.append(f"{began:.6f} {made:.6f} {reported:.6f} {preempted} {running} {kv} {keys}\n")

    PaddedEngine.step = stamped(PaddedEngine.step)  # type: ignore[method-assign]
    PagedEngine.step = stamped(PagedEngine.step)  # type: ignore[method-assign]
    TextGenerationRunner.step = stamped_runner_step  # type: ignore[method-assign]
    DeltaWriter.post = stamped_post  # type: ignore[method-assign]
    RedisSink.stream_now = stamped_stream_now  # type: ignore[method-assign]
    TokenWrites.send = stamped_send  # type: ignore[method-assign]

    names = path.with_name(path.name + ".threads")
    hand_path = path.with_name(path.name + ".hand")

    def flush() -> None:
        with path.open("a") as f, hand_path.open("a") as g:
            while True:
                time.sleep(0.05)
                for out, kept in ((f, lines), (g, hand)):
                    n = len(kept)
                    if n:
                        out.writelines(kept[:n])
                        del kept[:n]
                        out.flush()
                known = "".join(f"{t.native_id} {t.name}\n" for t in threading.enumerate())
                names.write_text(known)

    threading.Thread(target=flush, name="bench-stamps", daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    install(Path(argv[0]))
    from batchfleet.cli import main as cli_main

    return int(cli_main(argv[2:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
