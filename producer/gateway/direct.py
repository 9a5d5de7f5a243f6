"""OpenAI request bodies answered without HTTP, as the gateway's routes answer them: the
same translation (:mod:`.openai_fields`, :mod:`.pooling`), checks and submission
(:class:`~.state.Gateway`) and answers (:mod:`.answers`), for ``batchfleet run-batch``
(vLLM's ``run-batch``). Whole answers only: a batch line is not streamed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from ...schemas.errors import BatchfleetError
from ..aio import AsyncJob
from ..submit import new_request_id
from . import openai_fields
from .answers import chat_response, completion_response
from .endpoint import Answered, Endpoint, Submission
from .errors import ApiError, invalid, of_exception, of_result
from .handler import chosen_request_id
from .pooling import ENDPOINTS
from .replies import DOWN
from .split import merged, part_ids, split
from .state import Gateway

logger = logging.getLogger(__name__)

GENERATION: Final[dict[str, bool]] = {"/v1/chat/completions": True, "/v1/completions": False}
"""The generation URLs, each a chat (True) or a text completion."""
URLS: Final = (*GENERATION, *ENDPOINTS)
"""Every URL a body may be sent to: the gateway's generation and pooling routes."""
LET_GO_S: Final = 2.0
"""The longest a body's work, cancelled as Redis is lost, is waited for to end."""
CANCEL_ON_STOP_S: Final = 3.0
"""The longest the cancels of a stopped run's requests are waited for (Redis may be gone,
or silent: each command would wait out redis-py's socket timeouts)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One body's answer: the fleet request id it went as (a fresh one where it never got
    that far), the HTTP status the gateway would have answered with, and the answer's
    JSON (status 200) or OpenAI's error object."""

    request_id: str
    status: int
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class Watch(Protocol):
    """What run-batch knows of Redis (:class:`~batchfleet.run_batch_outage.RedisWatch`)."""

    @property
    def down(self) -> bool:
        """Redis is known unreachable now."""
        ...

    async def lost(self) -> BatchfleetError:
        """Returns once Redis has been unreachable too long: the error to answer with."""
        ...


async def answer(
    gateway: Gateway, url: str, body: Mapping[str, Any], models: Mapping[str, str] | None = None,
    watch: Watch | None = None, submitted: Callable[[str], object] | None = None,
) -> Outcome:  # fmt: skip
    """``body`` sent to ``url``, answered as the gateway answers it (never raises for the
    request's own faults: they are the outcome's ``error``). ``models`` maps a model the
    body names to the fleet's model that serves it; the answer names the body's. Its fleet
    requests left unanswered are cancelled. ``watch``: where Redis is lost, the body is
    answered its error at once, whatever it was doing (a submit, a read, a wait: each
    could hang on a silent network), and no cancel is tried while Redis is known down
    (it would ride out the producer's retries in vain: logged instead). ``submitted``:
    called with the fleet model of each request about to be sent (one a worker serves:
    a LoRA adapter's base, the model ``models`` maps to), whether the fleet takes it or
    refuses it (``queue_full``)."""
    sent = _Sent(new_request_id(), submitted=submitted)
    stopped = False
    try:
        sent.id = chosen_request_id(body.get("request_id")).get("request_id") or sent.id
        out = await _unless_lost(_routed(gateway, url, body, models or {}, sent), watch)
        return Outcome(sent.id, 200, out)
    except (ApiError, BatchfleetError) as exc:
        error = exc if isinstance(exc, ApiError) else of_exception(exc, body)
        return Outcome(sent.id, error.status, error=error.body())
    except DOWN as exc:  # a call outside the producer's retries (as the gateway's 503)
        error = ApiError(503, f"Redis unreachable: {exc}", code="unavailable")
        return Outcome(sent.id, error.status, error=error.body())
    except asyncio.CancelledError:  # run-batch stopped
        stopped = True
        raise
    finally:
        if sent.sent and not sent.ended:  # timed out, a part failed, Redis lost, or stopped
            await _cancel(gateway, sent.sent, watch, stopped)


async def _routed(
    gateway: Gateway, url: str, body: Mapping[str, Any], models: Mapping[str, str], sent: _Sent
) -> dict[str, Any]:
    if url in GENERATION:
        return await _generation(gateway, GENERATION[url], body, models, sent)
    if url in ENDPOINTS:
        return await _unary(gateway, ENDPOINTS[url], body, models, sent)
    raise ApiError(404, f"URL {url!r} is not served; the supported URLs: {', '.join(URLS)}",
                   code="not_found", param="url")  # fmt: skip


async def _unless_lost(work: Coroutine[Any, Any, T], watch: Watch | None) -> T:
    """``work``'s result; the watch's error once it says Redis is lost first (``work``
    cancelled, waited for :data:`LET_GO_S` at most: a cancel redis-py swallows, say)."""
    if watch is None:
        return await work
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(watch.lost())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=LET_GO_S)
            task.add_done_callback(_retrieved)
    if task.done() and not task.cancelled():
        return task.result()
    raise lost.result()


async def _cancel(
    gateway: Gateway, sent: list[tuple[str, str]], watch: Watch | None, stopped: bool
) -> None:
    """Cancel the fleet requests ``sent`` (model, request id): riding out the producer's
    retries, until the watch says Redis is lost; once run-batch is ``stopped``, for
    :data:`CANCEL_ON_STOP_S` at most (a stop is not held by an outage). Not tried while
    Redis is known down; each given up is logged."""
    ids = ", ".join(rid for _, rid in sent)
    if watch is not None and watch.down:
        logger.warning("run-batch: Redis unreachable: requests %s not cancelled (the fleet "
                       "may still answer them; nobody reads those results)", ids)  # fmt: skip
        return
    cancels = asyncio.gather(*(gateway.producer.cancel(rid, model=model) for model, rid in sent),
                             return_exceptions=True)  # fmt: skip
    lost = asyncio.ensure_future(watch.lost()) if watch is not None else None
    try:
        await asyncio.wait({cancels} | ({lost} if lost else set()),
                           timeout=CANCEL_ON_STOP_S if stopped else None,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    finally:
        if lost is not None:
            lost.cancel()
    if not cancels.done():
        cancels.cancel()
        cancels.add_done_callback(_retrieved)
        why = ("Redis unreachable" if lost is not None and lost.done() and not lost.cancelled()
               else f"no answer within {CANCEL_ON_STOP_S:g} s of the stop")  # fmt: skip
        logger.warning("run-batch: requests %s not cancelled: %s (the fleet may still answer "
                       "them; nobody reads those results)", ids, why)  # fmt: skip


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Its end read, whatever it is (never reported as an exception not retrieved)."""
    if not task.cancelled():
        task.exception()


@dataclass(slots=True)
class _Sent:
    """What one body became in the fleet: its request id, the (model, request id) of each
    fleet request sent, and whether they all ended (else they are cancelled: nobody reads
    their results)."""

    id: str
    sent: list[tuple[str, str]] = field(default_factory=list)
    ended: bool = False
    submitted: Callable[[str], object] | None = None
    """Told the model of each request about to be sent."""

    async def submit(self, gateway: Gateway, sub: Submission, request_id: str) -> AsyncJob:
        """Submit ``sub`` as ``request_id``; counted as sent from the start, so a run
        stopped while it is submitted still cancels it; not where it is refused."""
        await gateway.check_model(sub.model)  # (a 404: no model of the fleet's; cached)
        if self.submitted is not None:
            self.submitted(sub.model)
        self.sent.append((sub.model, request_id))
        try:
            return await gateway.submit(sub, request_id)
        except (ApiError, BatchfleetError):
            self.sent.pop()
            raise


def _mapped(sub: Submission, models: Mapping[str, str]) -> Submission:
    return Submission(models.get(sub.model, sub.model), sub.options)


async def _generation(
    gateway: Gateway, chat: bool, body: Mapping[str, Any], models: Mapping[str, str],
    sent: _Sent,
) -> dict[str, Any]:  # fmt: skip
    """``/v1/chat/completions`` or ``/v1/completions``, whole (as ``Generate`` answers it)."""
    if body.get("stream"):
        raise invalid("a batch line is answered whole: stream must be false (as vLLM's "
                      "run-batch)", "stream")  # fmt: skip
    body = gateway.token_ids_default(body)
    make = openai_fields.chat_submission if chat else openai_fields.completion_submission
    sub, alias = await gateway.served(_mapped(make(body), models))
    job = await sent.submit(gateway, sub, sent.id)
    answered = Answered(f"{'chatcmpl-' if chat else 'cmpl-'}{job.id}", int(time.time()),
                        sampling=await gateway.sampling(sub.model),
                        frontend=gateway.frontend)  # fmt: skip
    result = await gateway.replies.wait(job, gateway.timeout_s)
    sent.ended = True
    if not result.ok:
        raise of_result(result)
    result = result.model_copy(update={"model": alias or openai_fields.model_of(body)})
    return (chat_response if chat else completion_response)(body, result, answered)


async def _unary(
    gateway: Gateway, endpoint: Endpoint, body: Mapping[str, Any], models: Mapping[str, str],
    sent: _Sent,
) -> dict[str, Any]:  # fmt: skip
    """A pooling endpoint (as ``Unary`` answers it: split into parts, merged back)."""
    sub, _ = await gateway.served(_mapped(endpoint.submission(body), models))
    await gateway.check_model(sub.model)
    if endpoint.encoder:
        await gateway.refuse_generator(sub.model)
    parts = split(sub, *await gateway.limits(sub.model))
    jobs = [await sent.submit(gateway, part, part_id)
            for part, part_id in zip(parts, part_ids(sent.id, len(parts)), strict=True)]  # fmt: skip
    results = await gateway.results(jobs)  # (a part that fails: the others cancelled)
    sent.ended = True
    info = await gateway.model_info(sub.model)
    answered = Answered(f"{endpoint.id_prefix}-{sent.id}", int(time.time()),
                        info.max_model_len if info is not None else None)  # fmt: skip
    return endpoint.answer(body, merged(results), answered)
