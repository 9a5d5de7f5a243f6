"""The synchronous producer: submit requests, then poll or subscribe for their results."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from ..connection import connect, default_url, run_script_calls
from ..schemas.codec import decode_result
from ..schemas.errors import JobFailed, ResultTimeout
from ..schemas.keys import ModelKeys, default_reply_channel
from ..schemas.messages import DEFAULT_LIMITS, Format, Limits, Result
from .submit import (
    SUBMIT_LUA,
    LaneCache,
    Prepared,
    WebhookArg,
    accepted_ids,
    build_request,
    prepare,
    queue_full,
    unavailable,
)

PIPELINE_CHUNK = 1000
SWEEP_S = 2.0
"""A reply-channel listener re-reads stored results after this long without a message."""


@dataclass(frozen=True, slots=True)
class Job:
    """A submitted request: its id, and a way back to its result."""

    id: str
    model: str
    producer: Producer

    @property
    def result_key(self) -> str:
        return ModelKeys(self.model).result(self.id)

    def result(self, timeout: float | None = 30.0) -> Result:
        """Wait for the final result (polling its key). Raises :class:`ResultTimeout`."""
        return self.producer.wait(self, timeout)

    def outputs(self, timeout: float | None = 30.0) -> list[Any]:
        """The outputs of an ``ok`` result; raises :class:`JobFailed` on ``error``/``expired``."""
        return raise_for_status(self.result(timeout)).outputs or []

    def peek(self) -> Result | None:
        """The result if it is there now, else ``None``."""
        return self.producer.peek(self)


def raise_for_status(result: Result) -> Result:
    if result.status != "ok":
        err = result.error
        raise JobFailed(
            f"request {result.id} {result.status}: {err.message if err else ''}",
            err.code if err else "internal",
            result,
        )
    return result


class Producer:
    """Submits requests to a model's lane streams and fetches their results.

    ``Producer(url)`` or ``Producer(client=redis.Redis(...))``. Thread-safe for submits.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        limits: Limits = DEFAULT_LIMITS,
        wire_format: Format = "msgpack",
        default_priority: int = 1,
    ) -> None:
        self.url = url or default_url()
        self.client = client if client is not None else connect(self.url)
        self._submit = self.client.register_script(SUBMIT_LUA)
        self.limits = limits
        self.wire_format: Format = wire_format
        self.default_priority = default_priority
        self.client_id = uuid.uuid4().hex
        self.reply_channel = default_reply_channel(self.client_id)
        self._lanes = LaneCache()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- submitting ---------------------------------------------------------------------------

    def lanes(self, model: str) -> int:
        cached = self._lanes.get(model)
        if cached is not None:
            return cached
        return self._lanes.put(model, self.client.get(ModelKeys(model).lanes_key))

    def _prepare(
        self,
        model: str,
        inputs: str | Iterable[str],
        priority: int | None,
        deadline_ms: int | None,
        metadata: Mapping[str, str] | None,
        result_ttl_s: int | None,
        request_id: str | None,
        result_format: Format | None,
        webhook: WebhookArg = None,
    ) -> Prepared:
        request = build_request(
            model,
            inputs,
            limits=self.limits,
            request_id=request_id,
            deadline_ms=deadline_ms,
            reply=self.reply_channel,
            result_ttl_s=result_ttl_s,
            metadata=metadata,
            result_format=result_format,
            webhook=webhook,
        )
        lane = self.default_priority if priority is None else priority
        return prepare(request, lane, self.lanes(model), self.wire_format)

    def submit(
        self,
        model: str,
        inputs: str | Iterable[str],
        *,
        priority: int | None = None,
        deadline_ms: int | None = None,
        metadata: Mapping[str, str] | None = None,
        result_ttl_s: int | None = None,
        request_id: str | None = None,
        result_format: Format | None = None,
        webhook: WebhookArg = None,
    ) -> Job:
        """Queue one request (one or more input texts) on lane ``priority`` (0 = highest).

        ``webhook="https://..."`` (or ``{"url": ..., "secret_id": ..., "format": ...}``) also
        POSTs the result there, signed; the result stays pollable either way."""
        try:
            p = self._prepare(
                model,
                inputs,
                priority,
                deadline_ms,
                metadata,
                result_ttl_s,
                request_id,
                result_format,
                webhook,
            )
            self._submit(keys=p.keys, args=p.args)
        except redis.ResponseError as exc:
            raise (queue_full(exc) or exc) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(self.url, exc) from exc
        return Job(p.request.id, model, self)

    def submit_many(
        self,
        model: str,
        requests: Iterable[str | Sequence[str]],
        *,
        priority: int | None = None,
        deadline_ms: int | None = None,
        metadata: Mapping[str, str] | None = None,
        result_format: Format | None = None,
        webhook: WebhookArg = None,
    ) -> list[Job]:
        """Queue many requests (each a text or a list of texts), pipelined in chunks.

        Raises :class:`QueueFull` (with ``accepted``: the jobs that did go in) when a lane
        fills up part-way.
        """
        jobs: list[Job] = []
        try:
            prepared = [
                self._prepare(
                    model,
                    inputs,
                    priority,
                    deadline_ms,
                    metadata,
                    None,
                    None,
                    result_format,
                    webhook,
                )
                for inputs in requests
            ]
            for start in range(0, len(prepared), PIPELINE_CHUNK):
                chunk = prepared[start : start + PIPELINE_CHUNK]
                calls = [(p.keys, p.args) for p in chunk]
                replies = run_script_calls(self.client, self._submit, calls)
                ids, full = accepted_ids(chunk, replies)
                jobs += [Job(rid, model, self) for rid in ids]
                if full is not None:
                    full.accepted = jobs  # type: ignore[attr-defined]
                    raise full
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(self.url, exc) from exc
        return jobs

    # --- results ------------------------------------------------------------------------------

    def peek(self, job: Job) -> Result | None:
        raw = self.client.get(job.result_key)
        return None if raw is None else decode_result(raw)

    def wait(self, job: Job, timeout: float | None = 30.0) -> Result:
        """Poll ``job``'s result key, backing off from 1 ms to 25 ms between reads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        down: Exception | None = None
        while True:
            try:
                result = self.peek(job)
                down = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                result, down = None, exc  # Redis restarting: keep trying until the timeout
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                if down is not None:
                    raise unavailable(self.url, down)
                raise ResultTimeout(f"no result for {job.id} within {timeout}s")
            time.sleep(pause if down is None else 0.2)
            pause = min(pause * 1.5, 0.025)

    def results(self, jobs: Iterable[Job], timeout: float | None = 60.0) -> Iterator[Result]:
        """Yield results as they arrive on this producer's reply channel (no polling loop).

        Subscribes first, then fetches any already stored, so none is missed. Pub/sub is
        fire-and-forget, so after a reconnect or a quiet spell (``SWEEP_S``) it fetches the
        stored results again. Raises :class:`ResultTimeout` if some are still missing after
        ``timeout``.
        """
        waiting = {j.id: j for j in jobs}
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub: redis.client.PubSub | None = None
        try:
            while waiting:
                if deadline is not None and time.monotonic() >= deadline:
                    raise ResultTimeout(f"{len(waiting)} results missing after {timeout}s")
                try:
                    if pubsub is None:
                        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(self.reply_channel)
                        yield from self._stored(waiting)
                        swept = time.monotonic()
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None and msg.get("type") == "message":
                        result = decode_result(msg["data"])
                        if waiting.pop(result.id, None) is not None:
                            yield result
                    elif time.monotonic() - swept > SWEEP_S:
                        yield from self._stored(waiting)
                        swept = time.monotonic()
                except (redis.ConnectionError, redis.TimeoutError):
                    if pubsub is not None:
                        pubsub.close()
                    pubsub = None
                    time.sleep(0.2)
        finally:
            if pubsub is not None:
                pubsub.close()

    def _stored(self, waiting: dict[str, Job]) -> Iterator[Result]:
        ids = list(waiting)
        for start in range(0, len(ids), PIPELINE_CHUNK):
            chunk = ids[start : start + PIPELINE_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            for rid in chunk:
                pipe.get(waiting[rid].result_key)
            raws = pipe.execute()
            for rid, raw in zip(chunk, raws, strict=True):
                if raw is not None:
                    del waiting[rid]
                    yield decode_result(raw)
