"""The systems under test, each driven by the same open-loop submitter.

Every system runs its worker as a separate process on the harness's redis-server; the
harness submits from one thread and timestamps results on another as they become
visible (pushed on a pub/sub channel), both with ``time.perf_counter`` of this process:
one clock, submit → result visible to the producer.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hiredis
import msgpack
import redis

from .load import Load
from .models import ModelSpec

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 2000
"""At most this many due requests go out in one pipelined submit."""


@dataclass(slots=True)
class Run:
    """What one system did with one load: per request, submit/visible times and batch info."""

    system: str
    load: Load
    submitted: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    """Submit time minus scheduled arrival (how far the producer fell behind)."""
    done: list[float | None] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    batch_id: list[str] = field(default_factory=list)
    server: list[tuple[float, float, float, float]] = field(default_factory=list)
    """batchfleet only: the result's own timings (ms, Redis clock): queued, batch wait,
    inference, enqueue → stored; to split the end-to-end latency, never mixed with it."""
    timed_out: bool = False


def worker_env(spec: ModelSpec, url: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(
        os.environ,
        PYTHONPATH=path,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        BENCH_MODEL=spec.name,
        BENCH_REDIS_URL=url,
        BENCH_MAX_BATCH=str(spec.max_batch),
    )


class Subscriber:
    """A pub/sub connection read straight off its socket with hiredis's C parser, so the
    harness's collector keeps up with tens of thousands of results a second (redis-py's
    ``get_message`` costs tens of microseconds a message). Every message in one ``recv``
    is stamped with the time that ``recv`` returned."""

    def __init__(self, url: str, command: list[str]) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        self.sock.sendall(_resp(command))
        reply = self._next(5.0)[1]
        if not reply or reply[0][0] not in (b"subscribe", b"psubscribe"):
            raise RuntimeError(f"cannot subscribe: {reply!r}")

    def receive(self, timeout: float) -> tuple[float, list[list[bytes]]]:
        return self._next(timeout)

    def _next(self, timeout: float) -> tuple[float, list[list[bytes]]]:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return time.perf_counter(), []
        t = time.perf_counter()
        if not data:
            raise ConnectionError("redis closed the pub/sub connection")
        self.reader.feed(data)
        out = []
        while (msg := self.reader.gets()) is not False:
            out.append(msg)
        return t, out

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _resp(command: list[str]) -> bytes:
    out = [f"*{len(command)}\r\n".encode()]
    for part in command:
        raw = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class System:
    """Start a worker, submit a load open-loop, collect results; subclasses fill in how."""

    name = "system"

    def __init__(self, spec: ModelSpec, url: str, workdir: Path) -> None:
        self.spec = spec
        self.url = url
        self.workdir = workdir
        self.client = redis.Redis.from_url(url)
        self.arrived: dict[str, tuple[float, bool, int, str]] = {}
        self.server: dict[str, tuple[float, float, float, float]] = {}
        self._stop = threading.Event()
        self._collector: threading.Thread | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.log = workdir / f"{self.name}-{spec.name}.log"

    # --- to implement ---------------------------------------------------------------------

    def argv(self) -> list[str]:
        raise NotImplementedError

    def channel_command(self) -> list[str]:
        """The (P)SUBSCRIBE command the results are pushed on."""
        raise NotImplementedError

    def parse(self, msg: list[bytes]) -> tuple[str, bool, int, str] | None:
        """(id, ok, batch size, batch id) of a pushed result (a raw pub/sub message)."""
        raise NotImplementedError

    def submit(self, indices: range, load: Load) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return True

    # --- shared -----------------------------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()
        subscriber = Subscriber(self.url, self.channel_command())
        self._collector = threading.Thread(target=self._collect, args=(subscriber,), daemon=True)
        self._collector.start()
        env = worker_env(self.spec, self.url)
        self.process = subprocess.Popen(
            self.argv(), env=env, cwd=ROOT, stdout=self.log.open("ab"), stderr=subprocess.STDOUT
        )
        end = time.monotonic() + 120
        while not self.ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} worker exited:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} worker not ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stop.set()
        if self._collector is not None:
            self._collector.join(5)

    def _collect(self, subscriber: Subscriber) -> None:
        arrived = self.arrived
        with subscriber:
            while not self._stop.is_set():
                t, messages = subscriber.receive(0.05)
                for msg in messages:
                    parsed = self.parse(msg)
                    if parsed is not None:
                        rid, ok, size, bid = parsed
                        arrived[rid] = (t, ok, size, bid)

    def run(self, load: Load, drain_s: float, tick: Any = None) -> Run:
        """Submit ``load`` open-loop (each request at its arrival time, never waiting for
        results), then wait up to ``drain_s`` after the last submit for every result."""
        out = Run(self.name, load)
        keys: list[str] = []
        clock = time.perf_counter
        at = load.at
        start = clock() + 0.02
        i = 0
        while i < load.n:
            now = clock() - start
            if at[i] > now:
                time.sleep(at[i] - now)
                continue
            j = min(bisect.bisect_right(at, now, lo=i), i + CHUNK)
            t0 = clock()
            keys += self.submit(range(i, j), load)
            out.submitted += [t0] * (j - i)
            out.lag += [t0 - start - at[k] for k in range(i, j)]
            if tick is not None:
                tick(j - i)
            i = j
        end = clock() + drain_s
        pending = set(keys)
        while pending and clock() < end:
            time.sleep(0.02)
            pending.difference_update([k for k in pending if k in self.arrived])
        out.timed_out = bool(pending)
        for k in keys:
            if k in self.server:
                out.server.append(self.server.pop(k))
            got = self.arrived.pop(k, None)
            if got is None:
                out.done.append(None)
                out.ok.append(False)
                out.batch.append(0)
                out.batch_id.append("")
            else:
                out.done.append(got[0])
                out.ok.append(got[1])
                out.batch.append(got[2])
                out.batch_id.append(got[3])
        return out


class Batchfleet(System):
    """A ``batchfleet worker`` (Celery worker, pool solo) with one model; Producer API."""

    name = "batchfleet"
    adaptive = True

    def __init__(self, spec: ModelSpec, url: str, workdir: Path) -> None:
        super().__init__(spec, url, workdir)
        from batchfleet.producer import Producer

        self.producer = Producer(url)
        self.fleet = workdir / f"{self.name}-{spec.name}.toml"
        self.fleet.write_text(
            f'redis_url = "{url}"\n'
            "[worker]\nblock_ms = 100\n"
            '[metrics]\nport = 0\naddress = "127.0.0.1"\n'
            f"[models.{spec.name}]\n"
            f'handler = "{spec.handler}"\npath = "{spec.path}"\ndevice = "cpu"\nmax_tokens = 256\n'
            f"[models.{spec.name}.batch]\nmax_batch_size = {spec.max_batch}\n"
            f"max_wait_ms = 10\nadaptive = {'true' if self.adaptive else 'false'}\n"
        )

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "batchfleet", "worker", "--config", str(self.fleet),
                "--name", f"{self.name}-{self.spec.name}", "--loglevel", "WARNING"]  # fmt: skip

    def ready(self) -> bool:
        from batchfleet.schemas.keys import ModelKeys

        return bool(self.client.hexists(ModelKeys(self.spec.name).workers, self.argv()[-3]))

    def channel_command(self) -> list[str]:
        return ["SUBSCRIBE", self.producer.reply_channel]

    def parse(self, msg: list[bytes]) -> tuple[str, bool, int, str] | None:
        if msg[0] != b"message":
            return None
        r = msgpack.unpackb(msg[2])  # the harness's own fast path; clients use decode_result
        t = r["timings"]
        self.server[r["id"]] = (t["queued_ms"], t["batch_wait_ms"], t["inference_ms"],
                                t["total_ms"])  # fmt: skip
        return r["id"], r["status"] == "ok", t["batch_size"], t["batch_id"]

    def submit(self, indices: range, load: Load) -> list[str]:
        by_lane: dict[int, list[int]] = {}
        for k in indices:
            by_lane.setdefault(load.lanes[k], []).append(k)
        ids: dict[int, str] = {}
        for lane, ks in by_lane.items():
            jobs = self.producer.submit_many(
                self.spec.name, [load.texts[k] for k in ks], priority=lane
            )
            ids.update(zip(ks, (j.id for j in jobs), strict=True))
        return [ids[k] for k in indices]

    def stop(self) -> None:
        super().stop()
        self.producer.close()


class BatchfleetFixed(Batchfleet):
    """batchfleet with a fixed 10 ms window from the oldest request (``adaptive = false``)."""

    name = "batchfleet-fixed"
    adaptive = False


class CeleryPerRequest(System):
    """One Celery task per request: Redis broker and result backend, ``--pool solo``."""

    name = "celery"
    task = "bench.infer"
    queue = "bench.per_request"
    prefetch = 4  # Celery's default multiplier

    def __init__(self, spec: ModelSpec, url: str, workdir: Path) -> None:
        super().__init__(spec, url, workdir)
        from .celery_app import make_app

        self.app = make_app(url)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker",
                "--pool", "solo", "-Q", self.queue, "-n", f"{self.name}@%h",
                "--prefetch-multiplier", str(self.prefetch), "--loglevel", "WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip

    def channel_command(self) -> list[str]:
        return ["PSUBSCRIBE", "celery-task-meta-*"]

    def parse(self, msg: list[bytes]) -> tuple[str, bool, int, str] | None:
        if msg[0] != b"pmessage":
            return None
        meta = json.loads(msg[3])
        if meta.get("status") not in ("SUCCESS", "FAILURE"):
            return None
        res = meta.get("result") if meta["status"] == "SUCCESS" else {}
        res = res if isinstance(res, dict) else {}
        return (
            meta["task_id"],
            meta["status"] == "SUCCESS",
            int(res.get("b", 1)),
            res.get("bid", ""),
        )

    def submit(self, indices: range, load: Load) -> list[str]:
        ids = []
        for k in indices:
            tid = uuid.uuid4().hex
            self.app.send_task(self.task, args=[load.texts[k]], task_id=tid, queue=self.queue,
                               priority=load.lanes[k])  # fmt: skip
            ids.append(tid)
        return ids


class CeleryBatches(CeleryPerRequest):
    """``celery-batches``: flush every 10 ms or at the model's max batch; prefetch allows a
    full batch to be buffered (with Celery's default of 4 it never could be)."""

    name = "celery-batches"
    task = "bench.infer_batch"
    queue = "bench.batched"

    @property
    def prefetch(self) -> int:  # type: ignore[override]
        return self.spec.max_batch


SYSTEMS: dict[str, type[System]] = {
    s.name: s for s in (Batchfleet, BatchfleetFixed, CeleryPerRequest, CeleryBatches)
}
