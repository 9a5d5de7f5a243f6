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
restart the result's text, greedy answers the tokens of one-at-a-time ``generate``,
nothing pending, every token stream with a TTL. Exit 1 on any violation.

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
import importlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import redis
from batchfleet.producer import Producer
from batchfleet.schemas.codec import decode_result
from batchfleet.schemas.errors import ResultTimeout, StreamRestarted
from batchfleet.schemas.keys import ModelKeys
from batchfleet.schemas.messages import Delta

from batchfleet.redis_server import LocalRedis

from .gen_chaos_checks import Plan, Report, Seen, check_run
from .load import WORDS
from .systems import ROOT

MODEL = "chaos"
OPTIONS = {"kv_cache_tokens": 4096, "page_size": 16, "step_tokens": 64, "max_running": 16}
"""The tests' small cache and step budgets (tests/conftest.py ``TINY_LM_OPTIONS``)."""


def tiny_lm(workdir: Path, hidden: int) -> Path:
    """The tests' tiny random Llama (``tests/tiny_models.py``), a little deeper."""
    sys.path.insert(0, str(ROOT / "tests"))
    tiny_models: Any = importlib.import_module("tiny_models")
    path: Path = tiny_models.make_causal_lm(workdir / "tiny-lm", layers=4, hidden=hidden)
    return path


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


class Fleet:
    """Redis (AOF) and the worker processes; kill -9 and restart either."""

    def __init__(
        self, workdir: Path, workers: int, appendfsync: str, worker_opts: str, hidden: int
    ) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []
        self.born: list[int] = []
        self.lives = 0
        lm = tiny_lm(workdir, hidden)
        self.redis = LocalRedis(appendonly=True, appendfsync=appendfsync)
        self.url = self.redis.start()
        self.config = workdir / "fleet.toml"
        self.config.write_text(
            f'redis_url = "{self.url}"\n[worker]\n{worker_opts}\n'
            f'[models.{MODEL}]\nrunner = "text-generation"\npath = "{lm}"\n'
            f"[models.{MODEL}.options]\n" + "".join(f"{k} = {v}\n" for k, v in OPTIONS.items())
        )
        self.r = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            for i in range(workers):
                self.names.append(f"w{i}")
                self.born.append(0)
                self.procs.append(self._start(i))
            self.wait_ready(self.READY_S)
        except BaseException:  # (no orphaned workers or Redis when the start fails)
            self.stop()
            raise

    READY_S = 600.0
    """How long the workers may take to start: loading torch and the model took over 2 min
    on a 2-core machine shared with other work."""

    def wait_ready(self, within_s: float) -> None:
        end = time.monotonic() + within_s
        while not all(self.ready(i) for i in range(len(self.procs))):
            if time.monotonic() > end:
                raise TimeoutError(f"workers not ready: see the logs in {self.workdir}")
            time.sleep(0.1)

    def _start(self, i: int) -> subprocess.Popen[bytes]:
        self.lives += 1
        name, self.born[i] = self.names[i], int(time.time() * 1000)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        log = (self.workdir / f"{name}.log").open("ab")
        argv = [sys.executable, "-m", "batchfleet", "worker", "--config", str(self.config),
                "--name", name, "--loglevel", "INFO"]  # fmt: skip
        return subprocess.Popen(argv, env=dict(os.environ, **env), stdout=log, stderr=log)

    def ready(self, i: int) -> bool:
        """Worker ``i`` is up and serving: it has beaten since it was started."""
        beat = self.r.hget(ModelKeys(MODEL).workers, self.names[i])
        return self.procs[i].poll() is None and beat is not None and int(beat) >= self.born[i]

    def streaming(self) -> dict[str, list[tuple[str, int]]]:
        """Requests each consumer is generating now, past their first delta: named by its
        ``started`` key, unanswered, the token stream's last entry a delta written since
        that consumer's process started; (request id, that delta's seq) each."""
        keys = ModelKeys(MODEL)
        held: list[tuple[str, str]] = []
        for key in self.r.scan_iter(match=keys.started("*"), count=1000):
            rid = key.decode().rsplit(":", 1)[1]
            name: Any = self.r.get(key)
            if name is not None:
                held.append((rid, name.decode()))
        pipe = self.r.pipeline(transaction=False)
        for rid, _ in held:
            pipe.exists(keys.result(rid))
            pipe.xrevrange(keys.tokens(rid), count=1)
        replies = pipe.execute()
        born = {name: self.born[i] for i, name in enumerate(self.names)}
        out: dict[str, list[tuple[str, int]]] = {}
        for (rid, name), answered, last in zip(held, replies[::2], replies[1::2], strict=True):
            if answered or not last or b"end" in last[0][1] or name not in born:
                continue
            if int(last[0][0].split(b"-")[0]) >= born[name]:
                out.setdefault(name, []).append((rid, int(last[0][1][b"seq"])))
        return out

    def unended(self, rid: str) -> bool:
        """Request ``rid`` has no result and its token stream no end (yet)."""
        keys = ModelKeys(MODEL)
        last: Any = self.r.xrevrange(keys.tokens(rid), count=1)
        return not self.r.exists(keys.result(rid)) and bool(last) and b"end" not in last[0][1]

    def kill_worker(self, i: int, rng: random.Random) -> str:
        """kill -9 worker ``i`` and start it again: under its name half the time (a
        container restarted in place takes back its entries), else under a new one."""
        self.procs[i].kill()
        self.procs[i].wait()
        if rng.random() < 0.5:
            self.names[i] = f"w{i}-{self.lives}"
        self.procs[i] = self._start(i)
        return self.names[i]

    def kill_redis(self, down_s: float) -> None:
        self.redis.crash()
        time.sleep(down_s)
        self.redis.start()

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.stop()


class Chaos(threading.Thread):
    """kill -9, every ``every`` s (±50%) until every request is answered, of a worker
    generating a request past its first delta (one that has served since it started),
    waited for where there is none, so every kill lands mid-generation; the worker
    restarted; ``worker_kills`` of them at most (0: no bound). kill -9 of Redis
    ``redis_kills`` times, spread over the ``span`` s of submits. Each event logged with
    its time; ``cut``: the requests a kill cut mid-generation (their streams must show a
    restart)."""

    POLL_S = 0.1

    def __init__(
        self, fleet: Fleet, every: float, redis_kills: int, span: float, seed: int,
        worker_kills: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.kills_left = worker_kills or -1
        self.fleet, self.every, self.span = fleet, every, span
        self.rng = random.Random(seed)
        self.redis_at = [span * (k + 1) / (redis_kills + 1) for k in range(redis_kills)]
        self.events: list[tuple[float, str]] = []
        self.outages: list[tuple[float, float]] = []
        self.cut: list[str] = []
        self.done = threading.Event()
        self._start = 0.0

    def run(self) -> None:
        self._start = time.monotonic()
        while not self.done.wait(self.every * self.rng.uniform(0.5, 1.5)):
            if self._redis_due():
                self.redis_at.pop(0)
                down = time.monotonic()
                self.fleet.kill_redis(1.0)
                self.outages.append((down, time.monotonic()))
                self.events.append((down - self._start, "kill -9 redis, restarted after 1 s"))
                continue
            while self.kills_left and not self._kill_mid_generation():
                if self.done.wait(self.POLL_S) or self._redis_due():
                    break

    def _redis_due(self) -> bool:
        return bool(self.redis_at) and time.monotonic() - self._start >= self.redis_at[0]

    def _kill_mid_generation(self) -> bool:
        """kill -9 a worker streaming a request now, if one is; whether one was."""
        fleet = self.fleet
        try:
            streaming = fleet.streaming()
            up = [i for i, name in enumerate(fleet.names) if name in streaming and fleet.ready(i)]
        except redis.RedisError:
            return False
        if not up:
            return False
        at = time.monotonic() - self._start
        victim = self.rng.choice(up)
        held = streaming[fleet.names[victim]]
        name = fleet.kill_worker(victim, self.rng)
        try:  # (dead now: what it had not ended stays unended until another attempt)
            cut = [(rid, seq) for rid, seq in held if fleet.unended(rid)]
        except redis.RedisError:
            cut = []
        self.cut += [rid for rid, _ in cut]
        self.kills_left -= 1
        what = ", ".join(f"{rid} after seq {seq}" for rid, seq in cut) or "(all ended meanwhile)"
        self.events.append((at, f"kill -9 worker {victim} mid-generation of {what}, "
                                f"restarted as {name}"))  # fmt: skip
        return True


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
        finally:
            fleet.stop()


def drive(args: argparse.Namespace, fleet: Fleet, todo: list[Plan]) -> Report:
    producer = Producer(fleet.url, retry_for_s=60)
    watcher = ReplyWatcher(fleet.url, producer.reply_channel)
    watcher.start()
    watcher.ready.wait(10)
    span = args.requests / args.rate
    chaos = Chaos(fleet, args.kill_every, args.redis_restarts, span, args.seed, args.worker_kills)
    readers = ThreadPoolExecutor(args.readers)
    futures: dict[str, Future[Seen]] = {}
    jobs: dict[str, Any] = {}
    submitted: dict[str, float] = {}
    cancels: list[tuple[float, str]] = []

    def on_job(plan: Plan, job: Any) -> None:
        jobs[plan.rid] = job
        submitted[plan.rid] = time.monotonic()
        if plan.reader in ("deltas", "stream"):
            futures[plan.rid] = readers.submit(read, producer, plan, job)
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
    readers.shutdown(wait=False, cancel_futures=True)  # (an unanswered one's reader waits on)
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
    """Exit status 1 where the run broke an invariant."""
    return 1 if run(parse(argv)).violations else 0


if __name__ == "__main__":
    sys.exit(main())
