"""The asyncio producer: :class:`Producer`'s API, awaitable, with ``async for`` results.

An asyncio client runs the core's operations here (producer/core.py holds the logic).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Generator, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.asyncio.client import PubSub
from typing_extensions import Unpack

from ..cancels import cancels
from ..connection import AsyncClient, connect_async, run_script_calls_async
from ..redis_errors import unreachable
from ..schemas.errors import ProducerClosed
from ..schemas.messages import Delta, Request, Result
from ..webhooks.status import WebhookStatus, parse_status
from . import ops
from .aio_reads import Reads
from .core import JobRef, ManyOptions, SubmitOptions, generation_texts, raise_for_status
from .ops import Runner
from .shell import CANCEL_TTL_S, STREAM_TIMEOUT_S, ProducerShell
from .submit import Chat, InputsArg
from .tokens import DeltaFollower, Follower, Part, Restarted, TextFollower

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AsyncJob(JobRef):
    """A submitted request: its id, and a way back to its result (awaitable)."""

    producer: AsyncProducer

    async def result(self, timeout: float | None = 30.0) -> Result:
        """Wait for the final result (polling its key). Raises :class:`ResultTimeout`."""
        return await self.producer.wait(self, timeout)

    async def outputs(self, timeout: float | None = 30.0) -> list[Any]:
        """The outputs of an ``ok`` result; raises :class:`JobFailed` for any other status."""
        return raise_for_status(await self.result(timeout)).outputs or []

    async def peek(self) -> Result | None:
        """The result if it is there now, else ``None``."""
        return await self.producer.peek(self)

    async def webhook_status(self) -> WebhookStatus | None:
        """Where its webhook delivery stands (see :meth:`Job.webhook_status`)."""
        return parse_status(await self.producer.client.get(self.webhook_key))

    # --- generation: see Job ------------------------------------------------------------------

    async def text(self, timeout: float | None = 30.0) -> str:
        """:meth:`Job.text <batchfleet.producer.Job.text>`, awaitable."""
        (text,) = generation_texts(await self.result(timeout))
        return text

    def stream(
        self, timeout: float | None = STREAM_TIMEOUT_S, part: Part = "text"
    ) -> AsyncIterator[str]:
        """:meth:`Job.stream <batchfleet.producer.Job.stream>`: ``async for``."""
        self.check_streaming(one_input=True)
        return self.producer.follow(self, TextFollower(self.id, part), timeout)

    def deltas(self, timeout: float | None = STREAM_TIMEOUT_S) -> AsyncIterator[Delta | Restarted]:
        """:meth:`Job.deltas <batchfleet.producer.Job.deltas>`: ``async for``."""
        self.check_streaming(one_input=False)
        return self.producer.follow(self, DeltaFollower(), timeout)

    async def cancel(self, ttl_s: int = CANCEL_TTL_S) -> None:
        """Stop generating: :meth:`AsyncProducer.cancel`."""
        await self.producer.cancel(self, ttl_s=ttl_s)


_READS = (ops.Get, ops.GetMany, ops.XRead, ops.Sleep, ops.Subscribe, ops.Listen)
"""The waits' operations that a close cuts short (:mod:`.aio_reads`)."""


class AsyncProducer(ProducerShell[AsyncClient, AsyncJob]):
    """``async with AsyncProducer(url) as p: job = await p.submit("minilm", "text")``.

    The same options and behaviour as :class:`~batchfleet.producer.Producer`."""

    def _connect(self, url: str) -> AsyncClient:
        return connect_async(url)

    def _job(self, request: Request) -> AsyncJob:
        return AsyncJob.of(request, producer=self)  # type: ignore[no-any-return]

    _reads: Reads | None = None

    @property
    def reads(self) -> Reads:
        """The waits' reads under way (made on first use)."""
        if self._reads is None:
            self._reads = Reads()
        return self._reads

    @property
    def closed(self) -> bool:
        """:meth:`close` was called: waits under way end with :class:`ProducerClosed`."""
        return self.reads.closed

    async def close(self) -> None:
        self.reads.close()
        await self.client.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the core's operations, on the event loop --------------------------------------------

    async def _drive(self, runner: Runner[Any]) -> AsyncIterator[Result]:
        """Await each of ``runner``'s operations; results it emits go to the caller."""
        asked = cancels()
        async with contextlib.aclosing(_Subscription(self.client)) as subscription:
            for op in runner:
                if isinstance(op, ops.Emit):
                    yield op.item
                elif self.closed:
                    raise ProducerClosed("the producer was closed")
                else:
                    reply = self._do(op, subscription)
                    cut = isinstance(op, _READS)
                    runner.reply = await (self.reads.cut_at_close(reply) if cut else reply)
                    if cancels() > asked:  # swallowed on the way (see batchfleet.cancels)
                        raise asyncio.CancelledError()

    async def _do(self, op: ops.Op, subscription: _Subscription) -> Any:
        """The reply to ``op``; a connection error is returned, for the core to handle
        (:func:`~batchfleet.redis_errors.unreachable`)."""
        try:
            if isinstance(op, ops.Get):
                return await self.client.get(op.key)
            if isinstance(op, ops.GetMany):
                pipe = self.client.pipeline(transaction=False)
                for key in op.keys:
                    pipe.get(key)
                return await pipe.execute()
            if isinstance(op, ops.RunScript):
                return await run_script_calls_async(self.client, self._submit, op.calls)
            if isinstance(op, ops.XRead):
                reply = await self.client.xread({op.key: op.after}, op.count, ops.block_ms(op))
                return ops.stream_entries(reply)
            if isinstance(op, ops.SetEx):
                return await self.client.set(op.key, op.value, ex=op.ttl_s)
            if isinstance(op, ops.Sleep):
                return await asyncio.sleep(op.seconds)
            if isinstance(op, ops.Subscribe):
                return await subscription.open(op.channel)
            if isinstance(op, ops.Unsubscribe):
                return await subscription.aclose()
            if isinstance(op, ops.Listen):
                return await subscription.listen(op.timeout)
        except Exception as exc:  # (a temporary refusal as well: NOREPLICAS, CLUSTERDOWN...)
            if (down := unreachable(exc)) is None:
                raise
            return down
        raise TypeError(f"cannot carry out {op!r}")

    async def _call(self, steps: Generator[ops.Op, Any, T]) -> T:
        runner = Runner(steps)
        async for _ in self._drive(runner):
            raise RuntimeError("a core operation emitted results outside results()")
        return runner.value  # type: ignore[return-value]

    # --- submitting ---------------------------------------------------------------------------

    async def lanes(self, model: str) -> int:
        return await self._call(self.core.lanes(model))

    async def submit(
        self, model: str, inputs: InputsArg = None, **options: Unpack[SubmitOptions]
    ) -> AsyncJob:
        """:meth:`Producer.submit <batchfleet.producer.Producer.submit>`, awaitable."""
        return await self._call(self.core.submit(model, inputs, options))

    async def submit_many(
        self,
        model: str,
        requests: Iterable[InputsArg | Chat],
        **options: Unpack[ManyOptions],
    ) -> list[AsyncJob]:
        """:meth:`Producer.submit_many <batchfleet.producer.Producer.submit_many>`, awaitable."""
        return await self._call(self.core.submit_many(model, requests, options))

    # --- results ------------------------------------------------------------------------------

    async def peek(self, job: AsyncJob) -> Result | None:
        return await self._call(self.core.peek(job.model, job.id))

    async def wait(self, job: AsyncJob, timeout: float | None = 30.0) -> Result:
        """Poll ``job``'s result key (through Redis outages) until ``timeout``."""
        return await self._call(self.core.wait(job.model, job.id, timeout))

    async def results(
        self, jobs: Iterable[AsyncJob], timeout: float | None = 60.0
    ) -> AsyncIterator[Result]:
        """:meth:`Producer.results <batchfleet.producer.Producer.results>`: ``async for``."""
        steps = self.core.results({j.id: j.model for j in jobs}, timeout)
        async for result in self._drive(Runner(steps)):
            yield result

    # --- generation ---------------------------------------------------------------------------

    async def follow(
        self, job: JobRef, follower: Follower, timeout: float | None
    ) -> AsyncIterator[Any]:
        """What ``follower`` makes of ``job``'s token stream (``job.stream()``, ``job.deltas()``)."""
        async for item in self._drive(
            Runner(self.core.tokens(job.model, job.id, timeout, follower))
        ):
            yield item

    async def cancel(
        self, job: JobRef | str, *, model: str | None = None, ttl_s: int = CANCEL_TTL_S
    ) -> None:
        """:meth:`Producer.cancel <batchfleet.producer.Producer.cancel>`, awaitable."""
        await self._call(self.core.cancel(*self._target(job, model), ttl_s))


class _Subscription:
    """The pub/sub connection of one ``results()`` call, opened again after a disconnect."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.pubsub: PubSub | None = None

    async def open(self, channel: str) -> None:
        await self.aclose()
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await self.pubsub.subscribe(channel)

    async def listen(self, timeout: float) -> bytes | None:
        assert self.pubsub is not None, "Listen before Subscribe"
        msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
        return msg["data"] if msg is not None and msg.get("type") == "message" else None

    async def aclose(self) -> None:
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is not None:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError):
                # its connection may be gone already; older redis-py leaves aclose untyped
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
