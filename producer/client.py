"""The synchronous producer: submit requests, then poll or subscribe for their results.

It carries out the operations of :class:`~batchfleet.producer.core.ProducerCore`, where all
the logic is, with a blocking client.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.client import PubSub
from typing_extensions import Unpack

from ..connection import SyncClient, connect, run_script_calls
from ..redis_errors import unreachable
from ..schemas.messages import Delta, Request, Result
from ..webhooks.status import WebhookStatus, parse_status
from . import ops
from .core import JobRef, ManyOptions, SubmitOptions, generation_texts, raise_for_status
from .ops import Runner
from .shell import CANCEL_TTL_S, STREAM_TIMEOUT_S, ProducerShell
from .submit import Chat, InputsArg
from .tokens import DeltaFollower, Follower, Part, Restarted, TextFollower

__all__ = ["Job", "Producer", "raise_for_status"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Job(JobRef):
    """A submitted request: its id, and a way back to its result."""

    producer: Producer

    def result(self, timeout: float | None = 30.0) -> Result:
        """Wait for the final result (polling its key). Raises :class:`ResultTimeout`."""
        return self.producer.wait(self, timeout)

    def outputs(self, timeout: float | None = 30.0) -> list[Any]:
        """The outputs of an ``ok`` result; raises :class:`JobFailed` for any other status."""
        return raise_for_status(self.result(timeout)).outputs or []

    def peek(self) -> Result | None:
        """The result if it is there now, else ``None``."""
        return self.producer.peek(self)

    def webhook_status(self) -> WebhookStatus | None:
        """Where its webhook delivery stands (``delivered``, ``scheduled``, ``refused``...);
        ``None`` until an attempt has finished, or when it has no webhook."""
        return parse_status(self.producer.client.get(self.webhook_key))

    # --- generation -----------------------------------------------------------------------

    def text(self, timeout: float | None = 30.0) -> str:
        """The generated text of a one-input request (waits for the result); raises
        :class:`JobFailed` for a status other than ``ok``."""
        (text,) = generation_texts(self.result(timeout))
        return text

    def stream(
        self, timeout: float | None = STREAM_TIMEOUT_S, part: Part = "text"
    ) -> Iterator[str]:
        """The generated text as it is produced, piece by piece, until the request ends
        (submitted with ``stream=True``, one input). Then ``result()`` has its
        ``finish_reason`` and usage. ``part="content"``: the answer only (a reasoning
        model's without its reasoning, a request with tools without the calls' markup);
        ``"reasoning_content"``: the reasoning only. Raises :class:`NotStreamed`,
        :class:`ResultTimeout` after ``timeout`` s, :class:`StreamRestarted` (see
        docs/protocol.md)."""
        self.check_streaming(one_input=True)
        return self.producer.follow(self, TextFollower(self.id, part), timeout)

    def deltas(self, timeout: float | None = STREAM_TIMEOUT_S) -> Iterator[Delta | Restarted]:
        """Every :class:`Delta` of every input as it is produced, and a :class:`Restarted`
        marker where another worker starts the request again (the deltas before it are void)."""
        self.check_streaming(one_input=False)
        return self.producer.follow(self, DeltaFollower(), timeout)

    def cancel(self, ttl_s: int = CANCEL_TTL_S) -> None:
        """Stop generating: :meth:`Producer.cancel`."""
        self.producer.cancel(self, ttl_s=ttl_s)


class Producer(ProducerShell[SyncClient, Job]):
    """Submits requests to a model's lane streams and fetches their results.

    ``Producer(url)`` or ``Producer(client=redis.Redis(...))``. Thread-safe for submits.
    Connection errors are retried with backoff for ``retry_for_s`` seconds (default 10)
    before :class:`Unavailable` is raised (docs/reliability.md).
    """

    def _connect(self, url: str) -> SyncClient:
        return connect(url)

    def _job(self, request: Request) -> Job:
        return Job.of(request, producer=self)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- carrying out the core's operations ---------------------------------------------------

    def _drive(self, runner: Runner[Any]) -> Iterator[Result]:
        """Carry out ``runner``'s operations, yielding the results it emits."""
        with contextlib.closing(_Subscription(self.client)) as subscription:
            for op in runner:
                if isinstance(op, ops.Emit):
                    yield op.item
                else:
                    runner.reply = self._do(op, subscription)

    def _do(self, op: ops.Op, subscription: _Subscription) -> Any:
        """The reply to ``op``; a connection error is returned, for the core to handle
        (:func:`~batchfleet.redis_errors.unreachable`)."""
        try:
            if isinstance(op, ops.Get):
                return self.client.get(op.key)
            if isinstance(op, ops.GetMany):
                pipe = self.client.pipeline(transaction=False)
                for key in op.keys:
                    pipe.get(key)
                return pipe.execute()
            if isinstance(op, ops.RunScript):
                return run_script_calls(self.client, self._submit, op.calls)
            if isinstance(op, ops.XRead):
                reply = self.client.xread({op.key: op.after}, op.count, ops.block_ms(op))
                return ops.stream_entries(reply)
            if isinstance(op, ops.SetEx):
                return self.client.set(op.key, op.value, ex=op.ttl_s)
            if isinstance(op, ops.Sleep):
                return time.sleep(op.seconds)
            if isinstance(op, ops.Subscribe):
                return subscription.open(op.channel)
            if isinstance(op, ops.Unsubscribe):
                return subscription.close()
            if isinstance(op, ops.Listen):
                return subscription.listen(op.timeout)
        except Exception as exc:  # (a temporary refusal as well: NOREPLICAS, CLUSTERDOWN...)
            if (down := unreachable(exc)) is None:
                raise
            return down
        raise TypeError(f"cannot carry out {op!r}")

    def _call(self, steps: Generator[ops.Op, Any, T]) -> T:
        runner = Runner(steps)
        for _ in self._drive(runner):
            raise RuntimeError("a core operation emitted results outside results()")
        return runner.value  # type: ignore[return-value]

    # --- submitting ---------------------------------------------------------------------------

    def lanes(self, model: str) -> int:
        return self._call(self.core.lanes(model))

    def submit(self, model: str, inputs: InputsArg = None, **options: Unpack[SubmitOptions]) -> Job:
        """Queue one request (one or more inputs: texts, images, pairs...; or ``messages=``
        for a generation model) on lane ``priority`` (0 = highest).

        Other inputs: ``images=[bytes, ...]``, ``pairs=[(query, doc), ...]``, or ``query=``
        with ``documents=[...]`` (and ``top_n``) for a ranking; ``inputs`` may also mix kinds
        (bytes, ``(text, text_pair)`` tuples, input maps: docs/protocol.md, "Inputs").

        Options: ``priority``, ``deadline_ms``, ``metadata``, ``result_ttl_s``, ``request_id``,
        ``result_format``, ``webhook``; for generation ``messages``, ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``stream``,
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``min_new_tokens``, ``logprobs``, ``stop_token_ids``, ``logit_bias``, ``n``, ``ignore_eos``,
        ``include_stop_str_in_output``, ``truncate_prompt_tokens``, ``prompt_logprobs``,
        ``structured_outputs``, ``response_format``, ``tools``, ``tool_choice``,
        ``parallel_tool_calls``, ``allowed_token_ids``, ``skip_special_tokens``,
        ``bad_words``, ``chat_template_kwargs``, ``chat_template``, ``add_generation_prompt``,
        ``continue_final_message``, ``return_token_ids``, ``return_prompt_text``,
        ``cache_salt``, ``reasoning_effort``, ``lora``, ``add_special_tokens``,
        ``return_token_strs``, ``use_beam_search``, ``length_penalty``,
        ``thinking_token_budget`` (see
        :class:`SubmitOptions`). Raises
        :class:`RequestRejected` before Redis, :class:`QueueFull`, or :class:`Unavailable`
        (with ``unknown_ids``) once Redis stayed unreachable for ``retry_for_s``."""
        return self._call(self.core.submit(model, inputs, options))

    def submit_many(
        self,
        model: str,
        requests: Iterable[InputsArg | Chat],
        **options: Unpack[ManyOptions],
    ) -> list[Job]:
        """Queue many requests (each a text, a list of texts or a chat), pipelined in chunks.

        Raises :class:`QueueFull` (with ``accepted``: the jobs that did go in) when a lane
        fills up part-way, :class:`Unavailable` (with ``accepted`` and ``unknown_ids``) when
        Redis stays unreachable.
        """
        return self._call(self.core.submit_many(model, requests, options))

    # --- results ------------------------------------------------------------------------------

    def peek(self, job: Job) -> Result | None:
        return self._call(self.core.peek(job.model, job.id))

    def wait(self, job: Job, timeout: float | None = 30.0) -> Result:
        """Poll ``job``'s result key (through Redis outages) until ``timeout``."""
        return self._call(self.core.wait(job.model, job.id, timeout))

    def results(self, jobs: Iterable[Job], timeout: float | None = 60.0) -> Iterator[Result]:
        """Yield results as they arrive on this producer's reply channel (no polling loop).

        Subscribes first, then fetches any already stored, so none is missed; after a
        reconnect or a quiet spell (``sweep_s``) it fetches the stored results again. Raises
        :class:`ResultTimeout` if some are still missing after ``timeout``.
        """
        yield from self._drive(Runner(self.core.results({j.id: j.model for j in jobs}, timeout)))

    # --- generation ---------------------------------------------------------------------------

    def follow(self, job: JobRef, follower: Follower, timeout: float | None) -> Iterator[Any]:
        """What ``follower`` makes of ``job``'s token stream (``job.stream()``, ``job.deltas()``)."""
        yield from self._drive(Runner(self.core.tokens(job.model, job.id, timeout, follower)))

    def cancel(
        self, job: JobRef | str, *, model: str | None = None, ttl_s: int = CANCEL_TTL_S
    ) -> None:
        """Cancel a generation request (a job, or an id with ``model``): workers stop it within
        a step; its result is ``ok`` with the text so far and ``finish_reason`` ``cancelled``.
        The cancel key lives ``ttl_s`` (keep it above the time the request may still wait)."""
        self._call(self.core.cancel(*self._target(job, model), ttl_s))


class _Subscription:
    """Holds the pub/sub connection of a ``results()`` call; reopened after a disconnect."""

    def __init__(self, client: SyncClient) -> None:
        self.client = client
        self.pubsub: PubSub | None = None

    def open(self, channel: str) -> None:
        self.close()
        # RedisCluster.pubsub is untyped in older redis-py (typed in 8.2)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
        self.pubsub.subscribe(channel)

    def listen(self, timeout: float) -> bytes | None:
        assert self.pubsub is not None, "Listen before Subscribe"
        msg = self.pubsub.get_message(timeout=timeout)
        if msg is None or msg.get("type") != "message":
            return None
        return msg["data"]  # type: ignore[no-any-return]

    def close(self) -> None:
        pubsub, self.pubsub = self.pubsub, None
        if pubsub is None:
            return
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError):
            pubsub.close()  # the connection may be dead already
