"""The asyncio producer: the same API as :class:`Producer`, awaitable."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from ..connection import connect_async, default_url, run_script_calls_async
from ..schemas.codec import decode_result
from ..schemas.errors import ResultTimeout
from ..schemas.keys import ModelKeys, default_reply_channel
from ..schemas.messages import DEFAULT_LIMITS, Format, Limits, Result
from .client import PIPELINE_CHUNK, raise_for_status
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


@dataclass(frozen=True, slots=True)
class AsyncJob:
    id: str
    model: str
    producer: AsyncProducer

    @property
    def result_key(self) -> str:
        return ModelKeys(self.model).result(self.id)

    async def result(self, timeout: float | None = 30.0) -> Result:
        return await self.producer.wait(self, timeout)

    async def outputs(self, timeout: float | None = 30.0) -> list[Any]:
        return raise_for_status(await self.result(timeout)).outputs or []


class AsyncProducer:
    """``async with AsyncProducer(url) as p: job = await p.submit("minilm", "text")``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        client: aioredis.Redis | None = None,
        limits: Limits = DEFAULT_LIMITS,
        wire_format: Format = "msgpack",
        default_priority: int = 1,
    ) -> None:
        self.url = url or default_url()
        self.client = client or connect_async(self.url)
        self._submit = self.client.register_script(SUBMIT_LUA)
        self.limits = limits
        self.wire_format: Format = wire_format
        self.default_priority = default_priority
        self.client_id = uuid.uuid4().hex
        self.reply_channel = default_reply_channel(self.client_id)
        self._lanes = LaneCache()

    async def close(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lanes(self, model: str) -> int:
        cached = self._lanes.get(model)
        if cached is not None:
            return cached
        return self._lanes.put(model, await self.client.get(ModelKeys(model).lanes_key))

    async def _prepare(
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
        return prepare(request, lane, await self.lanes(model), self.wire_format)

    async def submit(
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
    ) -> AsyncJob:
        try:
            p = await self._prepare(
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
            await self._submit(keys=p.keys, args=p.args)
        except redis.ResponseError as exc:
            raise (queue_full(exc) or exc) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(self.url, exc) from exc
        return AsyncJob(p.request.id, model, self)

    async def submit_many(
        self,
        model: str,
        requests: Iterable[str | Sequence[str]],
        *,
        priority: int | None = None,
        deadline_ms: int | None = None,
        metadata: Mapping[str, str] | None = None,
        result_format: Format | None = None,
        webhook: WebhookArg = None,
    ) -> list[AsyncJob]:
        jobs: list[AsyncJob] = []
        try:
            prepared = [
                await self._prepare(
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
                replies = await run_script_calls_async(self.client, self._submit, calls)
                ids, full = accepted_ids(chunk, replies)
                jobs += [AsyncJob(rid, model, self) for rid in ids]
                if full is not None:
                    full.accepted = jobs  # type: ignore[attr-defined]
                    raise full
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise unavailable(self.url, exc) from exc
        return jobs

    async def peek(self, job: AsyncJob) -> Result | None:
        raw = await self.client.get(job.result_key)
        return None if raw is None else decode_result(raw)

    async def wait(self, job: AsyncJob, timeout: float | None = 30.0) -> Result:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while True:
            result = await self.peek(job)
            if result is not None:
                return result
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(f"no result for {job.id} within {timeout}s")
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, 0.025)

    async def results(
        self, jobs: Iterable[AsyncJob], timeout: float | None = 60.0
    ) -> AsyncIterator[Result]:
        """Yield results as they are published (subscribe first, then fetch stored ones)."""
        waiting = {j.id: j for j in jobs}
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.reply_channel)
        try:
            ids = list(waiting)
            for start in range(0, len(ids), PIPELINE_CHUNK):
                chunk = ids[start : start + PIPELINE_CHUNK]
                pipe = self.client.pipeline(transaction=False)
                for rid in chunk:
                    pipe.get(waiting[rid].result_key)
                for rid, raw in zip(chunk, await pipe.execute(), strict=True):
                    if raw is not None:
                        del waiting[rid]
                        yield decode_result(raw)
            deadline = None if timeout is None else time.monotonic() + timeout
            while waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ResultTimeout(f"{len(waiting)} results missing after {timeout}s")
                msg = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=min(left or 1.0, 1.0)
                )
                if msg is None or msg.get("type") != "message":
                    continue
                result = decode_result(msg["data"])
                if waiting.pop(result.id, None) is not None:
                    yield result
        finally:
            await pubsub.aclose()
