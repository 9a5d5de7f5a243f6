"""``batchfleet run-batch``: vLLM's ``run-batch`` over the fleet. Reads OpenAI's batch file
format (one request a line: ``{"custom_id", "method": "POST", "url", "body"}``), answers
each line as the gateway answers its URL (:mod:`~batchfleet.producer.gateway.direct`),
at most ``max_in_flight`` at a time, and writes one line per input line, in input order
as vLLM does: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. A line that cannot be sent or fails is an error line; nothing stops the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from .cancels import not_lost
from .connection import ping_redis
from .producer.aio import AsyncProducer
from .producer.core import DEFAULT_RETRY_FOR_S
from .producer.gateway.app import Gateway
from .producer.gateway.direct import Outcome, answer
from .producer.gateway.errors import ApiError, invalid
from .producer.gateway.frontend import Frontend
from .producer.submit import new_request_id
from .run_batch_metrics import RunBatchMetrics
from .run_batch_outage import RedisWatch
from .schemas.errors import ErrorCode

logger = logging.getLogger(__name__)

QUEUE_FULL_BACKOFF_S: Final = (0.1, 5.0)
"""A line refused as ``queue_full`` is sent again after the first, doubling up to the
second: the batch waits for room in the lanes rather than failing the line."""


@dataclass(frozen=True, slots=True)
class Line:
    """One input line as read: its request, or the error it is answered with."""

    custom_id: str | None
    """None where the line has none to read (not JSON, not a string)."""
    url: str = ""
    body: Mapping[str, Any] = field(default_factory=dict)
    error: ApiError | None = None


def parse_line(text: str, number: int) -> Line:
    """Line ``number`` (from 1) of the input, checked as vLLM's ``BatchRequestInput`` and
    OpenAI's batch input: a refusal names the line and the field."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return Line(None, error=invalid(f"line {number} is not JSON: {exc}"))
    if not isinstance(obj, dict):
        return Line(None, error=invalid(f"line {number} is not a JSON object"))
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str):
        return Line(None, error=invalid(f"line {number}: custom_id must be a string",
                                        "custom_id"))  # fmt: skip
    for name, kind in (("method", str), ("url", str), ("body", dict)):
        if not isinstance(obj.get(name), kind):
            what = "an object" if kind is dict else "a string"
            return Line(custom_id, error=invalid(f"line {number}: {name} must be {what}", name))
    if obj["method"] != "POST":
        return Line(custom_id, error=invalid(f"line {number}: method {obj['method']!r}: only "
                                             "POST is supported", "method"))  # fmt: skip
    return Line(custom_id, obj["url"], obj["body"])


def output_line(custom_id: str | None, outcome: Outcome) -> dict[str, Any]:
    """vLLM's ``BatchRequestOutput``: the answer's body on success, else a null body and
    the error object (OpenAI's ``{"error": {"message", "type", "param", "code"}}``).
    ``request_id`` is the fleet's (``batchfleet trace MODEL ID`` follows it)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": outcome.status,
            "request_id": outcome.request_id,
            "body": outcome.body,
        },
        "error": outcome.error,
    }


class OrderedWriter:
    """Writes output lines in input order as they come: a line answered before those
    above it waits (vLLM's ``OrderedStreamingWriter``)."""

    def __init__(self, write: Callable[[str], object]) -> None:
        self.write = write
        self.next = 0
        self.waiting: dict[int, dict[str, Any]] = {}
        self.failed = 0

    def add(self, index: int, line: dict[str, Any]) -> None:
        self.failed += line["error"] is not None
        self.waiting[index] = line
        while self.next in self.waiting:
            self.write(json.dumps(self.waiting.pop(self.next), ensure_ascii=False) + "\n")
            self.next += 1


@dataclass(frozen=True, slots=True)
class Settings:
    """How a batch is run (the command line's options)."""

    max_in_flight: int = 64
    """Lines being answered at once (each may be several fleet requests: split inputs)."""
    timeout_s: float | None = 3600.0
    """Seconds a line waits for its result (None: no limit)."""
    priority: int | None = None
    """The lane of lines that set none (None: the producer's default, 1)."""
    models: Mapping[str, str] = field(default_factory=dict)
    """A model the lines name → the fleet's model that serves it."""
    default_model: str | None = None
    """The model of lines whose body names none."""
    response_role: str = "assistant"
    """vLLM's ``--response-role``."""
    progress_s: float = 5.0
    """Seconds between progress lines on the log (0: none)."""
    retry_for_s: float = DEFAULT_RETRY_FOR_S
    """Seconds a Redis outage is ridden out (the producer's ``retry_for_s``): by a line's
    submit, by the lines waiting for their results, then 503 ``unavailable`` lines."""


@dataclass(slots=True)
class Summary:
    """What a run did."""

    lines: int = 0
    failed: int = 0
    in_flight: int = 0


async def run_batch(
    redis_url: str,
    lines: AsyncIterator[str],
    write: Callable[[str], object],
    settings: Settings | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    metrics: RunBatchMetrics | None = None,
) -> Summary:
    """Answer every line of ``lines`` through the fleet at ``redis_url``; ``write`` takes
    each output line (with its newline), in input order. Blank lines are skipped, as
    vLLM's. ``sleep``: how a ``queue_full`` line waits before it is sent again;
    ``metrics``: counted there as the run goes (``--enable-metrics``)."""
    settings = settings or Settings()
    summary = Summary()
    writer = OrderedWriter(write)
    metrics = metrics or RunBatchMetrics()
    metrics.in_flight.set_function(lambda: summary.in_flight)

    def written(index: int, custom_id: str | None, outcome: Outcome) -> None:
        metrics.line(outcome.status, outcome.error)
        writer.add(index, output_line(custom_id, outcome))

    async with AsyncProducer(redis_url, retry_for_s=settings.retry_for_s) as producer:
        gateway = Gateway(producer, timeout_s=settings.timeout_s, priority=settings.priority,
                          frontend=Frontend(response_role=settings.response_role))  # fmt: skip
        gateway.replies.start()
        watch = RedisWatch(producer, settings.retry_for_s)
        metrics.redis_reachable.set_function(lambda: 0 if watch.down else 1)
        fleet = metrics.watch_fleet(redis_url)
        room = asyncio.Semaphore(settings.max_in_flight)
        tasks: set[asyncio.Task[None]] = set()
        reporter = asyncio.ensure_future(_report(summary, writer, settings.progress_s))
        watching = asyncio.ensure_future(watch.run())

        async def one(index: int, line: Line) -> None:
            try:
                try:
                    with metrics.duration.time():
                        outcome = await _answer_line(gateway, watch, line, settings, sleep,
                                                     metrics.retries.inc, fleet.use)  # fmt: skip
                except Exception as exc:  # a fault of this program: that line says so
                    logger.exception("run-batch: line %r failed", line.custom_id)
                    outcome = _refused(ApiError(500, f"internal error: {type(exc).__name__}: "
                                                f"{exc}", code=ErrorCode.INTERNAL.value))  # fmt: skip
            finally:
                summary.in_flight -= 1
                room.release()
            written(index, line.custom_id, outcome)  # (no longer in flight once counted)

        try:
            await _started(producer, gateway, watch.ping_timeout_s + settings.retry_for_s)
            number = 0
            async for text in lines:
                number += 1
                if not text.strip():
                    continue
                index, summary.lines = summary.lines, summary.lines + 1
                metrics.read.inc()
                line = parse_line(text, number)
                if line.error is not None:
                    written(index, line.custom_id, _refused(line.error))
                    continue
                await room.acquire()
                summary.in_flight += 1
                task = asyncio.ensure_future(one(index, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # (a task cancelled once is cancelling its jobs: not twice)
                if not getattr(task, "cancelling", lambda: 0)():  # (Python 3.11+)
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # (their jobs cancelled)
            reporter.cancel()  # (its last line: what was written)
            await asyncio.gather(reporter, return_exceptions=True)
            await watch.close(watching)
            await gateway.replies.close()
            metrics.unwatch_fleet()
    summary.failed = writer.failed
    return summary


async def _started(producer: AsyncProducer, gateway: Gateway, within_s: float) -> None:
    """Redis answers (every master of a cluster) and the reply channel is subscribed; else
    (unreachable: fail now, not at every line) what the client raised, or :class:`redis.TimeoutError` after
    ``within_s`` (a silent network: redis-py's own tries would take a minute)."""

    async def start() -> None:
        await ping_redis(producer.client)
        await gateway.replies.subscribed.wait()

    try:
        await not_lost(asyncio.wait_for(start(), within_s))  # (3.11's keeps no cancel)
    except asyncio.TimeoutError:
        where = producer.url.split("@")[-1]  # (no credentials)
        raise redis.TimeoutError(f"Redis at {where} did not answer within {within_s:g} s") from None


def _refused(error: ApiError) -> Outcome:
    return Outcome(new_request_id(), error.status, error=error.body())


async def _answer_line(
    gateway: Gateway, watch: RedisWatch, line: Line, settings: Settings,
    sleep: Callable[[float], Awaitable[object]], retried: Callable[[], object],
    submitted: Callable[[str], object],
) -> Outcome:  # fmt: skip
    """``line`` answered; sent again while the fleet's lanes are full (nothing of it was
    taken: each time under a new request id, unless the body chose one); ``retried``
    called at each; ``submitted`` with the fleet model of each request sent."""
    body = line.body
    if "model" not in body and settings.default_model is not None:
        body = {**body, "model": settings.default_model}
    wait, waited = QUEUE_FULL_BACKOFF_S[0], 0.0
    while True:
        outcome = await answer(gateway, line.url, body, settings.models, watch=watch,
                               submitted=submitted)  # fmt: skip
        full = outcome.error is not None and outcome.error["error"].get("code") == (
            ErrorCode.QUEUE_FULL.value)  # fmt: skip
        if not full or (settings.timeout_s is not None and waited >= settings.timeout_s):
            return outcome
        retried()
        await sleep(wait)
        waited += wait
        wait = min(wait * 2, QUEUE_FULL_BACKOFF_S[1])


async def _report(summary: Summary, writer: OrderedWriter, every_s: float) -> None:
    """A progress line every ``every_s`` seconds, and a last one when the run ends,
    however short (vLLM's progress bar, as log lines: tqdm prints its bar at its close)."""
    if every_s <= 0:
        return
    started = time.monotonic()
    try:
        while True:
            await asyncio.sleep(every_s)
            _progress(summary, writer, started, "")
    finally:
        _progress(summary, writer, started, "end: ")


def _progress(summary: Summary, writer: OrderedWriter, started: float, what: str) -> None:
    logger.info("run-batch: %s%d lines read, %d written (%d failed), %d in flight, %.0f s",
                what, summary.lines, writer.next, writer.failed, summary.in_flight,
                time.monotonic() - started)  # fmt: skip


def run(
    source: str,
    destination: str,
    redis_url: str,
    settings: Settings | None = None,
    tmp_dir: str | None = None,
    metrics_at: tuple[str, int] | None = None,
) -> int:
    """``batchfleet run-batch``: exit 0 where every line was answered (200), 1 where some
    are error lines (or the fleet or the upload failed), 2 where the input is unreadable
    or the metrics cannot be served at ``metrics_at`` (address, port), 130 where it was
    stopped (Ctrl-C)."""
    from .run_batch_metrics import MetricsServer

    metrics = RunBatchMetrics()
    try:
        server = MetricsServer(metrics, *metrics_at) if metrics_at else None
    except OSError as exc:
        print(f"batchfleet run-batch: cannot serve metrics at {metrics_at}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        return _run(source, destination, redis_url, settings, tmp_dir, metrics)
    finally:
        if server is not None:
            server.close()


def _run(
    source: str, destination: str, redis_url: str, settings: Settings | None,
    tmp_dir: str | None, metrics: RunBatchMetrics,
) -> int:  # fmt: skip
    from .batch_files import UploadFailed, lines_of, open_input, output

    try:
        stream = open_input(source)
    except (OSError, ValueError) as exc:
        print(f"batchfleet run-batch: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a URL slow to answer)
        print("batchfleet run-batch: stopped before the run started; nothing written",
              file=sys.stderr)  # fmt: skip
        return 130
    try:
        with stream, output(destination, tmp_dir) as out:
            summary = asyncio.run(run_batch(redis_url, lines_of(stream), out.write, settings,
                                            metrics=metrics))  # fmt: skip
    except KeyboardInterrupt:
        print("batchfleet run-batch: stopped; the lines in flight were cancelled (the log "
              "names any not: Redis unreachable), those written are kept", file=sys.stderr)  # fmt: skip
        return 130
    except UploadFailed as exc:
        print(f"batchfleet run-batch: {exc}", file=sys.stderr)
        return 1
    except (redis.RedisError, OSError) as exc:
        print(f"batchfleet run-batch: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    where = "stdout" if destination == "-" else destination
    print(f"batchfleet run-batch: {summary.lines} lines answered, {summary.failed} with an "
          f"error, to {where}", file=sys.stderr)  # fmt: skip
    return 1 if summary.failed else 0
