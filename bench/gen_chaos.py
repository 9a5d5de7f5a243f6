"""``python -m bench.gen_chaos``: a chaos run for generation. Real processes throughout:
a ``redis-server`` with ``appendonly yes``, 2-3 generating workers serving the tests' tiny
random Llama, a producer submitting streaming requests over the lanes (mixed lengths,
some greedy, some sampled with a seed, some with ``stop``, some cancelled, some with a
deadline), readers following each token stream (``job.deltas()``, ``job.stream()``, or the
reply channel's delta messages), while a chaos thread kill -9s a random worker every few
seconds (restarting it) and kill -9s/restarts Redis a few times.

At the end every request is checked (:mod:`bench.gen_chaos_checks`): exactly one result
and one token-stream end (a second result write appends a second end: ``finish.lua``
stores both in one call), an allowed status, the stored stream's attempts each numbered
``1..k`` and the last one's text the result's, what each reader saw after its last
restart the result's text, greedy answers the tokens of one-at-a-time ``generate``
(but for float32 ties, reported apart: :mod:`bench.gen_chaos_greedy`), nothing pending,
every token stream with a TTL. Exit 1 on any violation; Ctrl-C (SIGINT) stops the run,
its workers and Redis at once (kill -9), exit 130.

Redis runs with ``appendfsync always`` by default: docs/reliability.md promises nothing
acknowledged is lost then. With ``everysec`` a Redis crash may lose up to a second of
writes, token-stream entries included (a gap in ``seq`` the worker cannot know of), so
that setting is for watching what breaks, not a check.

Kill pace and poison: every kill counts a delivery for each entry the killed worker held,
waiting ones too, so a request held by 4 killed workers is answered ``poisoned`` (by
design, and allowed here) and little of it is checked. Keep ``--kill-every`` above the
time a worker takes to restart (3-6 min on a 2-core machine
shared with other work), or the fleet is down most of the run and kills pile up on the
worker that just came back: ``--kill-every 20`` there poisoned 44 of the first 231
answers (bench/results/gen-chaos-2026-12-07.md); an older full run with the defaults
(every 4 s, no bound) poisoned 315 of 600. Bound the kills (``--worker-kills``) and space
them to the machine rather than loosening ``max_deliveries``: the worker's is checked.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.errors import ResultTimeout, StreamRestarted
from batchfleet.schemas.messages import Delta

from .gen_chaos_checks import Plan, Report, Seen, check_run
from .gen_chaos_fleet import MODEL, Chaos, Fleet
from .load import WORDS

INTERRUPTED = 130
"""The exit status of a run stopped by Ctrl-C (SIGINT), its processes stopped: the
shells' 128 + SIGINT."""
T = TypeVar("T")


def plans(n: int, rng: random.Random, readers: tuple[int, ...] = (4, 2, 2, 1)) -> list[Plan]:
    """``n`` request shapes: lengths, decoding, stops, cancels, deadlines and reader mixed."""
    out = []
    for i in range(n):
        greedy = rng.random() < 0.6
        reader = rng.choices(["deltas", "stream", "reply", "none"], readers)[0]
        if reader == "stream" and not greedy:
            reader = "deltas"  # job.stream() raises when a sampled restart differs: by design
        out.append(
            Plan(
                rid=f"chaos-{i}",
                prompt=" ".join(rng.choices(WORDS, k=rng.randint(2, 40))),
                max_new=rng.choice([4, 16, 64, 128, 256, 480]),
                lane=rng.choices([0, 1, 2], [2, 5, 3])[0],
                greedy=greedy,
                ignore_eos=rng.random() < 0.5,
                stop=[rng.choice(WORDS)] if rng.random() < 0.2 else None,
                cancel_after=rng.uniform(0.0, 3.0) if rng.random() < 0.1 else None,
                deadline_ms=rng.randint(300, 6000) if rng.random() < 0.1 else None,
                reader=reader,
            )
        )
    return out


class ReplyWatcher(threading.Thread):
    """Records every message on the producer's reply channel (deltas and results), and
    the spans it was not subscribed (pub/sub drops what comes then)."""

    def __init__(self, url: str, channel: str) -> None:
        super().__init__(daemon=True)
        self.url, self.channel = url, channel
        self.deltas: dict[str, list[tuple[int, int, str]]] = {}
        self.results: dict[str, int] = {}
        self.deaf: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            lost = time.monotonic()
            try:
                pubsub = redis.Redis.from_url(self.url).pubsub()
                pubsub.subscribe(self.channel)
                while pubsub.get_message(timeout=1.0) is None:
                    pass
                if self.ready.is_set():
                    self.deaf.append((lost, time.monotonic()))
                self.ready.set()
                while not self.done.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if not msg or msg["type"] != "message":
                        continue
                    body = msgpack.unpackb(msg["data"])
                    if isinstance(body, dict) and body.get("kind") == "delta":
                        piece = (int(body["seq"]), int(body["input"]), str(body["text"]))
                        self.deltas.setdefault(str(body["id"]), []).append(piece)
                    else:
                        rid = decode_result(msg["data"]).id
                        self.results[rid] = self.results.get(rid, 0) + 1
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.2)


class Readers:
    """``threads`` daemon threads running the readers: unlike a ``ThreadPoolExecutor``'s
    (joined at interpreter exit), a reader still waiting on its stream when the run ends
    or is interrupted does not keep the process alive (an interrupted run hung so)."""

    def __init__(self, threads: int) -> None:
        self._todo: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        for _ in range(threads):
            threading.Thread(target=self._work, daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._todo.put((fut, fn))
        return fut

    def cancel_waiting(self) -> None:
        """Cancel the readers not started yet."""
        while True:
            try:
                fut, _ = self._todo.get_nowait()
            except queue.Empty:
                return
            fut.cancel()

    def _work(self) -> None:
        while True:
            fut, fn = self._todo.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # (handed to whoever waits on it)
                fut.set_exception(exc)


def read(producer: Producer, plan: Plan, job: Any) -> Seen:
    """Follow one request's stream as its plan says; what the reader saw."""
    seen = Seen()
    try:
        if plan.reader == "deltas":
            for d in job.deltas(timeout=600):
                seen.events.append(d if isinstance(d, Delta) else None)
        elif plan.reader == "stream":
            seen.text = "".join(job.stream(timeout=600))
    except StreamRestarted as exc:
        seen.error = f"StreamRestarted: {exc}"
    except Exception as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    return seen


def submit_all(
    producer: Producer, todo: list[Plan], rate: float, on_job: Callable[[Plan, Any], None]
) -> None:
    """Submit each plan at ``rate`` a second (streamed, on its lane)."""
    start = time.monotonic()
    for i, plan in enumerate(todo):
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        options: dict[str, Any] = {
            "max_new_tokens": plan.max_new,
            "stream": True,
            "priority": plan.lane,
            "request_id": plan.rid,
            "return_token_ids": True,
            "ignore_eos": plan.ignore_eos,
            "temperature": 0.0 if plan.greedy else 1.0,
        }
        if not plan.greedy:
            options["seed"] = i
        if plan.stop:
            options["stop"] = plan.stop
        if plan.deadline_ms:
            options["deadline_ms"] = plan.deadline_ms
        on_job(plan, producer.submit(MODEL, plan.prompt, **options))


def run(args: argparse.Namespace) -> Report:
    """Run the chaos run ``args`` describe; its report (printed too)."""
    rng = random.Random(args.seed)
    todo = plans(args.requests, rng, tuple(int(w) for w in args.reader_mix.split(",")))
    with tempfile.TemporaryDirectory(prefix="gen-chaos-") as tmp:
        workdir = Path(args.workdir or tmp)
        opts = (
            f"heartbeat_timeout_ms = {args.heartbeat_timeout_ms}\n"
            f"claim_idle_ms = {args.claim_idle_ms}\n"
        )
        fleet = Fleet(workdir, args.workers, args.appendfsync, opts, args.hidden)
        print(f"fleet up: redis {fleet.url} (appendfsync {args.appendfsync}), "
              f"{args.workers} workers; logs in {workdir}", flush=True)  # fmt: skip
        try:
            return drive(args, fleet, todo)
        except KeyboardInterrupt:  # Ctrl-C: nothing of the fleet's to keep
            print("interrupted: stopping the workers and Redis", file=sys.stderr, flush=True)
            fleet.stop(at_once=True)
            raise
        finally:
            fleet.stop()


def drive(args: argparse.Namespace, fleet: Fleet, todo: list[Plan]) -> Report:
    producer = Producer(fleet.url, retry_for_s=60)
    watcher = ReplyWatcher(fleet.url, producer.reply_channel)
    watcher.start()
    watcher.ready.wait(10)
    span = args.requests / args.rate
    chaos = Chaos(fleet, args.kill_every, args.redis_restarts, span, args.seed, args.worker_kills)
    readers = Readers(args.readers)
    futures: dict[str, Future[Seen]] = {}
    jobs: dict[str, Any] = {}
    submitted: dict[str, float] = {}
    cancels: list[tuple[float, str]] = []

    def on_job(plan: Plan, job: Any) -> None:
        jobs[plan.rid] = job
        submitted[plan.rid] = time.monotonic()
        if plan.reader in ("deltas", "stream"):
            futures[plan.rid] = readers.submit(lambda: read(producer, plan, job))
        if plan.cancel_after is not None:
            cancels.append((time.monotonic() + plan.cancel_after, plan.rid))

    def cancel_loop() -> None:
        while len(cancels) or len(jobs) < len(todo):
            due = [c for c in cancels if c[0] <= time.monotonic()]
            for c in due:
                cancels.remove(c)
                producer.cancel(c[1], model=MODEL)
            time.sleep(0.05)

    started = time.monotonic()
    chaos.start()
    try:
        canceller = threading.Thread(target=cancel_loop, daemon=True)
        canceller.start()
        submit_all(producer, todo, args.rate, on_job)
        print(f"submitted {len(todo)} in {time.monotonic() - started:.0f} s", flush=True)
        results = {}
        try:
            for res in producer.results(list(jobs.values()), timeout=args.timeout):
                results[res.id] = res
                if len(results) % 100 == 0:
                    print(f"{len(results)} answered at {time.monotonic() - started:.0f} s",
                          flush=True)  # fmt: skip
        except ResultTimeout as exc:  # checked all the same: each missing one a violation
            print(f"{exc} (--timeout): checking what was answered", flush=True)
        canceller.join(30)
    finally:
        chaos.done.set()
        chaos.join()
    seen = {rid: f.result(timeout=args.timeout) for rid, f in futures.items() if rid in results}
    readers.cancel_waiting()  # (an unanswered one's reader waits on, a daemon)
    time.sleep(1.0)  # the reply channel's last messages
    watcher.done.set()
    elapsed = time.monotonic() - started
    for at, what in chaos.events:
        print(f"  {at:6.1f} s  {what}")
    r = redis.Redis.from_url(fleet.url)
    deaf = chaos.outages + watcher.deaf
    report = check_run(r, MODEL, todo, results, seen, watcher, submitted, deaf, args.verify,
                       fleet.config, args.claim_idle_ms / 1000 + 30, set(chaos.cut))  # fmt: skip
    report.events = [what for _, what in chaos.events]
    report.print(elapsed)
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gen_chaos", description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--rate", type=float, default=5.0, help="submits a second")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256,
                   help="the model's width: slow enough on a CPU that kills land mid-generation")  # fmt: skip
    p.add_argument("--kill-every", type=float, default=4.0, help="seconds between kills (±50%%)")
    p.add_argument("--worker-kills", type=int, default=0,
                   help="kill -9 of workers at most this many times (0: until every answer)")  # fmt: skip
    p.add_argument("--redis-restarts", type=int, default=2)
    p.add_argument("--appendfsync", default="always", choices=["always", "everysec"])
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    p.add_argument("--claim-idle-ms", type=int, default=20_000,
                   help="the idle fallback: takes an entry whose read reply a Redis kill lost")  # fmt: skip
    p.add_argument("--readers", type=int, default=48, help="threads following streams")
    p.add_argument("--reader-mix", default="4,2,2,1",
                   help="weights of job.deltas(), job.stream(), reply channel, no reader")  # fmt: skip
    p.add_argument("--verify", type=int, default=60,
                   help="greedy answers checked against generate (restarted ones first)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 where the run broke an invariant; :data:`INTERRUPTED` where Ctrl-C
    stopped it (its processes stopped first)."""
    try:
        report = run(parse(argv))
    except KeyboardInterrupt:
        return INTERRUPTED
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
