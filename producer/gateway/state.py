"""The :class:`Gateway`: what every route's handler shares, and the fleet as they see it.

One per gateway process: the :class:`AsyncProducer` every request is submitted through, the
settings, the stores, and short-lived caches of what the workers publish (the models, their
limits and info, read again after ``MODELS_CACHE_S``), so a request costs no Redis round
trip for them. Every route submits through :meth:`Gateway.submit` (and ``run-batch`` too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import redis

from ...schemas.chat import UNTRUSTED_TEMPLATE
from ...schemas.errors import BatchfleetError
from ...schemas.keys import (
    LANES_KEY_PATTERN,
    MODELS_KEY,
    ModelKeys,
    model_names,
    model_of_lanes_key,
)
from ...schemas.messages import Result
from ...schemas.model_info import ModelInfo, decode_model_info
from ..aio import AsyncJob, AsyncProducer
from . import openai_fields
from .conversations import ConversationStore
from .endpoint import Submission
from .errors import ApiError, invalid, of_result
from .fingerprint import Fingerprints
from .frontend import Frontend, without_tools
from .metrics import GatewayMetrics
from .readiness import Readiness
from .replies import Replies
from .retried import retried
from .stored import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, ResponseStore

if TYPE_CHECKING:
    from .dev_routes import DevAdmin
    from .lora_admin import LoraAdmin

logger = logging.getLogger(__name__)

MODELS_CACHE_S = 5.0


class Gateway:
    """What every handler shares: the producer, the settings, the models seen."""

    def __init__(
        self,
        producer: AsyncProducer,
        *,
        api_key: str | None = None,
        timeout_s: float | None = 3600.0,
        priority: int | None = None,
        store_ttl_s: int = DEFAULT_TTL_S,
        store_max_bytes: int = DEFAULT_MAX_BYTES,
        conversations: Mapping[str, int] | None = None,
        lora_admin: LoraAdmin | None = None,
        dev_admin: DevAdmin | None = None,
        return_tokens_as_token_ids: bool = False,
        frontend: Frontend | None = None,
    ) -> None:
        self.producer = producer
        self.readiness = Readiness(producer.client)
        """Whether Redis answers, for ``/health`` (:mod:`.readiness`)."""
        self.frontend = frontend or Frontend()
        """vLLM's frontend switches of the chat and completion answers (:mod:`.frontend`)."""
        self.fingerprints = Fingerprints(self.frontend, producer.client, self.model_info,
                                         MODELS_CACHE_S)  # fmt: skip
        """Each model's ``system_fingerprint`` (:mod:`.fingerprint`)."""
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        """vLLM's ``--return-tokens-as-token-ids``: the default of the chat and completion
        requests' ``return_tokens_as_token_ids`` (each may set its own)."""
        self.lora_admin = lora_admin
        """Runtime LoRA updating (``--allow-runtime-lora-updating``): None, its routes are
        not served."""
        self.dev_admin = dev_admin
        """vLLM's development routes (``--server-dev-mode``): None, they are not served."""
        self.responses = ResponseStore(producer.client, store_ttl_s, store_max_bytes)
        """The Responses API's stored responses."""
        self.conversations = ConversationStore(producer.client, **(conversations or {}))
        """The Conversations API's conversations (``conversations``: their ``ttl_s``,
        ``max_items`` and ``max_bytes``)."""
        self.replies = Replies(producer)
        self.metrics = GatewayMetrics()
        self.metrics.watch(lambda: len(self.inflight), lambda: float(self.replies.live))
        self.routes: frozenset[str] = frozenset()
        """The paths served (``make_app`` sets them): the metrics' route labels."""
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.priority = priority
        self._models: tuple[float, list[str]] = (0.0, [])
        self._seen: dict[str, float] = {}
        self._limits: dict[str, tuple[float, tuple[int, int] | None]] = {}
        """Model → when its lanes key was last seen (checked again after MODELS_CACHE_S)."""
        self._info: dict[str, tuple[float, ModelInfo | None]] = {}
        self.pending: set[asyncio.Task[None]] = set()
        """Cancellations under way (kept referenced until done)."""
        self.inflight: set[AsyncJob] = set()
        """Submitted requests whose client is still being answered."""
        self.stopping = False
        """Shutting down: new requests are refused (503)."""
        self.load = 0
        """Requests to the fleet's routes being answered (vLLM's ``server_load``: ``/load``)."""

    async def models(self) -> list[str]:
        """The models the fleet serves: the set its workers announce them in (a SCAN of
        their lanes keys where the workers are too old to write it), read with retries."""
        at, names = self._models
        if time.monotonic() - at > MODELS_CACHE_S:
            names = await retried(self._read_models, self.retry_for_s, "the models' read")
            self._models = (time.monotonic(), names)
        return names

    @property
    def retry_for_s(self) -> float:
        """How long the gateway's own reads retry (:mod:`.retried`): the producer's bound."""
        return self.producer.core.retry_for_s

    async def _read_models(self) -> list[str]:
        names = model_names(await self.producer.client.smembers(MODELS_KEY))
        return names or await self._scanned_models()

    async def _scanned_models(self) -> list[str]:
        found = set()
        try:
            async for key in self.producer.client.scan_iter(match=LANES_KEY_PATTERN, count=1000):
                name = model_of_lanes_key(key.decode() if isinstance(key, bytes) else key)
                if name:
                    found.add(name)
        except redis.exceptions.NoPermissionError:  # deploy/'s gateway user may not SCAN
            logger.warning("no worker announced its model in %s, and SCAN is refused", MODELS_KEY)
        return sorted(found)

    async def check_model(self, model: str) -> None:
        """404 unless a worker of ``model`` ever started (its lanes key is there); its read
        retried as the producer's calls are (a failover is no 503 where a retry serves)."""
        try:
            keys = ModelKeys(model)
        except ValueError as exc:
            raise ApiError(404, str(exc), code="model_not_found", param="model") from None
        if time.monotonic() - self._seen.get(model, -MODELS_CACHE_S) < MODELS_CACHE_S:
            return
        started = await retried(lambda: self.producer.client.exists(keys.lanes_key),
                                self.retry_for_s, f"the model check of {model!r}")  # fmt: skip
        if not started:
            raise ApiError(404, f"The model {model!r} does not exist: no worker serves it",
                           code="model_not_found", param="model")  # fmt: skip
        self._seen[model] = time.monotonic()

    async def limits(self, model: str) -> tuple[int, int]:
        """``model``'s ``max_inputs`` and ``max_entry_bytes``, as its workers published them
        (checked again after MODELS_CACHE_S); the protocol's defaults where none did."""
        at, known = self._limits.get(model, (-MODELS_CACHE_S, None))
        if known is not None and time.monotonic() - at < MODELS_CACHE_S:
            return known
        limits = self.producer.limits
        found = (limits.max_inputs, limits.max_entry_bytes)
        raw = await self._read(ModelKeys(model).limits, f"the limits of {model!r}")
        try:
            published = json.loads(raw) if raw is not None else {}
            found = (int(published.get("max_inputs", found[0])),
                     int(published.get("max_entry_bytes", found[1])))  # fmt: skip
        except (ValueError, TypeError, AttributeError) as exc:
            logger.warning("limits of %s unreadable (%s): taking the defaults", model, exc)
        self._limits[model] = (time.monotonic(), found)
        return found

    async def model_info(self, model: str) -> ModelInfo | None:
        """What ``model``'s workers published of it (read again after MODELS_CACHE_S); None
        where none did (workers older than ``bf:{model}:info``) or it is unreadable."""
        at, known = self._info.get(model, (-MODELS_CACHE_S, None))
        if time.monotonic() - at < MODELS_CACHE_S:
            return known
        raw = await self._read(ModelKeys(model).info, f"the info of {model!r}")
        try:
            known = decode_model_info(raw) if raw is not None else None
        except ValueError as exc:
            logger.warning("info of %s unreadable (%s): left out", model, exc)
            known = None
        self._info[model] = (time.monotonic(), known)
        return known

    async def _read(self, key: str, what: str) -> bytes | str | None:
        """``key``'s value, read with retries (:mod:`.retried`) as the model check is: a
        failover is never taken for "nothing published" (the defaults, or no info, would
        be kept for MODELS_CACHE_S); past ``retry_for_s`` the failure is raised (503). A
        refusal that is Redis's answer (``NOPERM``, ``WRONGTYPE``) reads as nothing."""
        try:
            return await retried(lambda: self.producer.client.get(key), self.retry_for_s, what)
        except redis.ResponseError as exc:
            logger.warning("%s unreadable (%s): taken as none published", what, exc)
            return None

    async def sampling(self, model: str) -> dict[str, float | int]:
        """``model``'s sampling defaults, as its workers published them (none: greedy)."""
        info = await self.model_info(model)
        return {} if info is None else info.sampling_defaults

    def forget_info(self, model: str) -> None:
        """Read ``model``'s info again when next asked (its workers changed it)."""
        self._info.pop(model, None)

    async def adapters(self) -> dict[str, str]:
        """LoRA adapter name → its base model, over the models the fleet serves (vLLM's:
        each adapter is a model of its own, named in ``model``)."""
        names = await self.models()
        infos = await asyncio.gather(*(self.model_info(n) for n in names))
        found: dict[str, str] = {}
        for base, info in zip(names, infos, strict=True):
            for name in info.lora_adapters if info is not None else ():
                found.setdefault(name, base)  # the first base, where two have one name
        return found

    async def served(self, sub: Submission) -> tuple[Submission, str | None]:
        """``sub`` as the fleet takes it: naming a LoRA adapter (not a model), it goes to
        the adapter's base model with ``lora``; and the adapter's name, to answer under.
        Its messages' text parts as the model's workers take them (:meth:`_parts`); its
        tools left out where the gateway leaves them out (:func:`.frontend.without_tools`)."""
        sub = Submission(sub.model, without_tools(sub.options, self.frontend))
        if "lora" in sub.options or sub.model in await self.models():
            return await self._parts(sub), None
        base = (await self.adapters()).get(sub.model)
        if base is None:
            return await self._parts(sub), None
        return await self._parts(Submission(base, sub.options | {"lora": sub.model})), sub.model

    async def _parts(self, sub: Submission) -> Submission:
        """``sub`` with its messages' text parts kept where the model's workers publish
        that they take them (``ModelInfo.content_parts``), else joined by newlines: older
        workers take text only, and it is the text a ``string``-format template renders."""
        messages = sub.options.get("messages")
        if not isinstance(messages, list) or not any(
            isinstance(m, Mapping) and isinstance(m.get("content"), list) for m in messages
        ):
            return sub  # fmt: skip
        info = await self.model_info(sub.model)
        if info is not None and info.content_parts:
            return sub
        return Submission(
            sub.model, sub.options | {"messages": [openai_fields.joined(m) for m in messages]}
        )

    def token_ids_default(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """``body`` with the gateway's default ``return_tokens_as_token_ids`` where it sets
        none."""
        if body.get(openai_fields.TOKEN_IDS) is None and self.return_tokens_as_token_ids:
            return {**body, openai_fields.TOKEN_IDS: True}
        return body

    async def submit(self, sub: Submission, request_id: str | None = None) -> AsyncJob:
        """``sub`` into the fleet, as every route submits (and ``batchfleet run-batch``): a
        404 for a model no worker serves, a 400 for what its workers publish that they refuse, the
        gateway's default lane where it names none; ``request_id``: the fleet's id."""
        await self.check_model(sub.model)
        await self._refuse_up_front(sub)
        options = dict(sub.options)
        if request_id is not None:
            options["request_id"] = request_id
        if "priority" not in options and self.priority is not None:
            options["priority"] = self.priority
        return await self.producer.submit(sub.model, **options)

    async def _refuse_up_front(self, sub: Submission) -> None:
        """A 400, before a round trip to the workers, for what they publish that they refuse:
        a ``thinking_token_budget`` without reasoning markers
        (``ModelInfo.thinking_token_budget``), a request's own ``chat_template`` where they
        do not trust one (``ModelInfo.trust_request_chat_template``: vLLM's words); a model
        with no word on it (older workers) is asked as before."""
        budget = sub.options.get("thinking_token_budget") is not None
        template = sub.options.get("chat_template") is not None
        if not budget and not template:
            return
        info = await self.model_info(sub.model)
        if info is None:
            return
        if budget and info.thinking_token_budget is False:
            raise invalid(f"thinking_token_budget: model {sub.model!r} has no reasoning markers "
                          "(its workers' reasoning_parser with tags, or reasoning_config)",
                          "thinking_token_budget")  # fmt: skip
        if template and info.trust_request_chat_template is False:
            raise invalid(UNTRUSTED_TEMPLATE, "chat_template")

    async def refuse_generator(self, model: str) -> None:
        """A 400 for a pooling request to a model its workers publish as generating (a
        chat template or not, only a generator tells: ``ModelInfo.chat_template``), before
        its worker takes the texts as prompts and generates its default answer for each;
        a model with no info (workers older than it) is asked as before."""
        info = await self.model_info(model)
        if info is not None and info.chat_template is not None:
            raise invalid(f"model {model!r} generates text (its workers run {info.task!r}): "
                          "embeddings, scores, reranks and classifications are answered by "
                          "encoder models", "model")  # fmt: skip

    async def results(self, jobs: list[AsyncJob]) -> list[Result]:
        """Every job's ``ok`` result, in order (a unary request's parts); the first that
        fails raises at once."""
        waits = [asyncio.ensure_future(self.replies.wait(job, self.timeout_s)) for job in jobs]
        try:
            for done in asyncio.as_completed(waits):
                if not (result := await done).ok:
                    raise of_result(result)
            return [wait.result() for wait in waits]
        finally:
            for wait in waits:
                wait.cancel()

    def route_of(self, path: str) -> str:
        """A request path's route label in the metrics (one per route: few labels)."""
        if path in self.routes:
            return path
        if path.startswith("/v1/responses/"):
            for tail in ("/input_items", "/cancel"):
                if path.endswith(tail):
                    return "/v1/responses/{id}" + tail
            return "/v1/responses/{id}"
        if path.startswith("/v1/conversations/"):
            depth = path.count("/") - 3  # 0: a conversation, 1: its items, 2: one item
            return "/v1/conversations/{id}" + ("", "/items", "/items/{item_id}")[min(depth, 2)]
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

    def cancel(self, job: AsyncJob) -> None:
        """Cancel ``job`` in the background (its client is gone)."""
        task = asyncio.ensure_future(self._cancel(job))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _cancel(self, job: AsyncJob) -> None:
        try:
            await job.cancel()
        except BatchfleetError as exc:
            logger.warning("could not cancel %s after its client left: %s", job.id, exc)
