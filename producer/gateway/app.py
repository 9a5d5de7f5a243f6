"""The gateway's HTTP side (tornado): routes, API key, JSON in and out, server-sent events.

Each HTTP request becomes one fleet request through one shared :class:`AsyncProducer`:
the gateway holds no model and no queue of its own, so any number of gateways can stand
in front of one fleet. A client that goes away (its connection closed) cancels its
request, so the fleet stops generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import redis
import tornado.httputil
import tornado.iostream
import tornado.web

from ...schemas.chat import UNTRUSTED_TEMPLATE
from ...schemas.errors import BatchfleetError, ErrorCode
from ...schemas.keys import (
    LANES_KEY_PATTERN,
    MODELS_KEY,
    REQUEST_ID,
    ModelKeys,
    model_names,
    model_of_lanes_key,
)
from ...schemas.messages import Result
from ...schemas.model_info import ModelInfo, decode_model_info
from ..aio import AsyncJob, AsyncProducer
from ..submit import new_request_id
from ..tokens import Restarted
from . import openai_fields
from .answers import chat_response, completion_response
from .chunks import Chunks, Diverged
from .conversations import ConversationStore
from .cors import Cors
from .endpoint import Answered, Endpoint, Events, Submission
from .errors import ApiError, invalid, of_exception, of_result
from .fingerprint import Fingerprints
from .frontend import Frontend, without_tools
from .metrics import CLIENT_LEFT, GatewayMetrics
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .replies import DOWN, Replies
from .serving import Rooted, Tls, listen
from .split import merged, part_ids, split
from .stored import DEFAULT_MAX_BYTES, DEFAULT_TTL_S, ResponseStore

if TYPE_CHECKING:
    from .dev_routes import DevAdmin
    from .lora_admin import LoraAdmin

logger = logging.getLogger(__name__)

MODELS_CACHE_S = 5.0
OPEN_PATHS = frozenset({"/health", "/livez", "/ping", "/load", "/version", "/metrics"})
"""Paths answered without the API key: what probes, load balancers and Prometheus poll
(vLLM's ``PUBLIC_ENDPOINTS``, and ``/livez``)."""
DEFAULT_MAX_BODY = 32 * 1024 * 1024


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
        their lanes keys where the workers are too old to write it)."""
        at, names = self._models
        if time.monotonic() - at > MODELS_CACHE_S:
            client = self.producer.client
            names = model_names(await client.smembers(MODELS_KEY))
            if not names:
                names = await self._scanned_models()
            self._models = (time.monotonic(), names)
        return names

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
        """404 unless a worker of ``model`` ever started (its lanes key is there)."""
        try:
            keys = ModelKeys(model)
        except ValueError as exc:
            raise ApiError(404, str(exc), code="model_not_found", param="model") from None
        if time.monotonic() - self._seen.get(model, -MODELS_CACHE_S) < MODELS_CACHE_S:
            return
        if not await self.producer.client.exists(keys.lanes_key):
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
        try:
            raw = await self.producer.client.get(ModelKeys(model).limits)
            published = json.loads(raw) if raw is not None else {}
            found = (int(published.get("max_inputs", found[0])),
                     int(published.get("max_entry_bytes", found[1])))  # fmt: skip
        except (*DOWN, redis.ResponseError, ValueError, TypeError, AttributeError) as exc:
            logger.warning("limits of %s unreadable (%s): taking the defaults", model, exc)
        self._limits[model] = (time.monotonic(), found)
        return found

    async def model_info(self, model: str) -> ModelInfo | None:
        """What ``model``'s workers published of it (read again after MODELS_CACHE_S); None
        where none did (workers older than ``bf:{model}:info``) or it is unreadable."""
        at, known = self._info.get(model, (-MODELS_CACHE_S, None))
        if time.monotonic() - at < MODELS_CACHE_S:
            return known
        try:
            raw = await self.producer.client.get(ModelKeys(model).info)
            known = decode_model_info(raw) if raw is not None else None
        except (*DOWN, redis.ResponseError, ValueError) as exc:
            logger.warning("info of %s unreadable (%s): left out", model, exc)
            known = None
        self._info[model] = (time.monotonic(), known)
        return known

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


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Made once: ``json.dumps`` with options makes one a call (one a streamed event)."""


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


def chosen_request_id(rid: object) -> dict[str, Any]:
    """A fleet request id a client chose, as submit options (none: empty); a 400 where it
    is not one."""
    if rid is None:
        return {}
    if not isinstance(rid, str) or not REQUEST_ID.match(rid):
        raise invalid("a request id has 1-128 of letters, digits and _.:-", "request_id")
    return {"request_id": rid}


class Handler(tornado.web.RequestHandler):
    """Shared by every route: the key check, OpenAI's error answers, the metrics."""

    gateway: Gateway
    load_aware = False
    """Its POST requests count in the gateway's :attr:`~Gateway.load` while answered."""

    def initialize(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.gone = False
        """The client closed the connection before its answer ended."""
        self.left = asyncio.Event()
        """Set as :attr:`gone` is (for what waits on something else meanwhile)."""
        self.route = gateway.route_of(self.request.path)
        self._measured = False
        gateway.metrics.started(self.route)
        self._loading = self.load_aware and self.request.method == "POST"
        gateway.load += self._loading

    def set_default_headers(self) -> None:
        """A cross-origin request's CORS headers (kept by :meth:`fail`'s ``clear``)."""
        cors: Cors | None = self.application.settings.get("cors")
        origin = self.request.headers.get("Origin")
        if cors is not None and origin is not None:
            for name, value in cors.simple(origin, self.request.headers).items():
                self.set_header(name, value)

    def prepare(self) -> None:
        if self._preflight():
            return
        if self.gateway.stopping and self.request.method == "POST":
            return self.fail(ApiError(503, "the gateway is shutting down", code="unavailable"))
        key = self.gateway.api_key
        # browsers send no key on a preflight: OPTIONS is not checked, as vLLM's
        if key is None or self.request.path in OPEN_PATHS or self.request.method == "OPTIONS":
            return
        given = self.request.headers.get("Authorization", "")
        # Anthropic's clients send the key as x-api-key
        token = given[7:] if given.startswith("Bearer ") else self.request.headers.get(
            "x-api-key", "")  # fmt: skip
        if not hmac.compare_digest(token.encode(), key.encode()):
            self.fail(ApiError(401, "Incorrect API key: send Authorization: Bearer <key> "
                               "(or x-api-key: <key>)", code="invalid_api_key"))  # fmt: skip

    def _preflight(self) -> bool:
        """Answer a CORS preflight (on any path, before routing, as Starlette's middleware)
        where the gateway allows cross-origin requests (True: answered)."""
        cors: Cors | None = self.application.settings.get("cors")
        headers = self.request.headers
        method = headers.get("Access-Control-Request-Method")
        if cors is None or self.request.method != "OPTIONS" or method is None:
            return False
        if "Origin" not in headers:
            return False
        answer = cors.preflight(headers["Origin"], method,
                                headers.get("Access-Control-Request-Headers"))  # fmt: skip
        self.clear()
        for name, value in answer.headers.items():
            self.set_header(name, value)
        self.set_status(answer.status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(answer.text)
        return True

    def error_body(self, error: ApiError) -> dict[str, Any]:
        """The JSON of an error answer: OpenAI's error object (a route may have its own)."""
        return error.body()

    def fail(self, error: ApiError) -> None:
        """Answer with ``error`` (nothing was sent yet)."""
        self.clear()
        self.set_status(error.status)
        self.set_header("Content-Type", "application/json")
        self.finish(dumps(self.error_body(error)))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """An exception no handler answered: Redis unreachable mid-request (a call outside
        the producer's retries) is a 503, anything else a 500."""
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, DOWN):
            error = ApiError(503, f"Redis unreachable: {exc}", code="unavailable")
        elif status_code >= 500:
            error = ApiError(status_code, "internal server error", code=ErrorCode.INTERNAL.value)
        else:
            error = ApiError(status_code, self._reason)
        self.fail(error)

    def send_json(self, obj: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(dumps(obj))

    def body_json(self) -> Mapping[str, Any]:
        try:
            body = json.loads(self.request.body or b"null")
        except ValueError as exc:
            raise invalid(f"the body is not JSON: {exc}") from None
        if not isinstance(body, Mapping):
            raise invalid("the body must be a JSON object")
        return body

    def request_id(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The fleet request id the client chose (``X-Request-Id`` or vLLM's ``request_id``):
        resubmitted, the same id gets the same single result."""
        return chosen_request_id(self.request.headers.get("X-Request-Id") or body.get("request_id"))

    async def submit(
        self, sub: Submission, body: Mapping[str, Any], request_id: str | None = None
    ) -> AsyncJob:
        chosen = self.request_id(body).get("request_id")
        job = await self.gateway.submit(sub, chosen if request_id is None else request_id)
        self.gateway.inflight.add(job)
        self.set_header("X-Request-Id", job.id)
        return job

    def count_tokens(self, result: Result) -> None:
        """An ``ok`` result's tokens, in the metrics."""
        if result.usage is not None:
            usage = result.usage
            self.gateway.metrics.tokens(result.model, usage.prompt_tokens, usage.completion_tokens)

    def _measured_as(self, status: int) -> None:
        if not self._measured:
            self._measured = True
            self.gateway.load -= self._loading
            self.gateway.metrics.ended(self.route, self.request.method or "", status,
                                       self.request.request_time())  # fmt: skip

    def on_connection_close(self) -> None:
        self.gone = True
        self.left.set()
        if not self._finished:
            self._measured_as(CLIENT_LEFT)

    def on_finish(self) -> None:
        self._measured_as(CLIENT_LEFT if self.gone else self.get_status())
        job = getattr(self, "job", None)
        if job is not None:
            self.gateway.inflight.discard(job)


class Metrics(Handler):
    """``/metrics``: Prometheus' text format (no key, as vLLM's)."""

    def get(self) -> None:
        self.set_header("Content-Type", METRICS_CONTENT_TYPE)
        self.finish(self.gateway.metrics.exposition())


class Models(Handler):
    async def get(self, name: str | None = None) -> None:
        try:
            names = await self.gateway.models()
            adapters = await self.gateway.adapters()
        except BatchfleetError as exc:
            return self.fail(of_exception(exc))
        shown = [*names, *(a for a in adapters if a not in names)]
        if name is not None:
            if name not in shown:
                return self.fail(ApiError(404, f"The model {name!r} does not exist",
                                          code="model_not_found"))  # fmt: skip
            shown = [name]
        bases = [adapters.get(n, n) if n not in names else n for n in shown]
        infos = await asyncio.gather(*(self.gateway.model_info(b) for b in bases))
        cards = [model_card(n, i, None if n == b else b)
                 for n, b, i in zip(shown, bases, infos, strict=True)]  # fmt: skip
        self.send_json({"object": "list", "data": cards} if name is None else cards[0])


def _named(alias: str | None) -> Callable[[Result], Result]:
    """A result as answered under ``alias`` (a LoRA adapter's name: vLLM's answers name
    the model asked for), or as it is."""
    if alias is None:
        return lambda result: result
    return lambda result: result.model_copy(update={"model": alias})


def model_card(name: str, info: ModelInfo | None, parent: str | None = None) -> dict[str, Any]:
    """vLLM's model card: ``max_model_len`` (and ``created``) where the model's workers
    published them, left out where they did not (workers older than ``bf:{model}:info``);
    a LoRA adapter's names its base model ``parent`` (its ``info``: the base's)."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                            "owned_by": "batchfleet", "root": name, "parent": parent}  # fmt: skip
    if info is not None:
        card["created"] = info.created
        if info.max_model_len is not None:
            card["max_model_len"] = info.max_model_len
    return card


class Health(Handler):
    """``/health``: 200 when Redis answers and the reply channel is subscribed (ready),
    else 503, also once it is stopping; ``/livez``: 200 while the process serves HTTP at
    all (alive)."""

    def initialize(self, gateway: Gateway, deep: bool = True) -> None:
        super().initialize(gateway)
        self.deep = deep

    async def get(self) -> None:
        if self.deep and self.gateway.stopping:
            return self.fail(ApiError(503, "the gateway is shutting down", code="unavailable"))
        if self.deep:
            try:
                await self.gateway.producer.client.ping()
            except Exception as exc:
                return self.fail(ApiError(503, f"Redis unreachable: {exc}", code="unavailable"))
            if not self.gateway.replies.live:
                return self.fail(ApiError(503, "not subscribed to the reply channel yet",
                                          code="unavailable"))  # fmt: skip
        self.set_status(200)
        self.finish()


class Unary(Handler):
    """An endpoint answered once from the result (embeddings, scores, ...); more inputs
    than a fleet request takes go as several (``split.py``), answered as one."""

    endpoint: Endpoint
    load_aware = True

    def initialize(self, gateway: Gateway, endpoint: Endpoint) -> None:  # type: ignore[override]
        super().initialize(gateway)
        self.endpoint = endpoint
        self.jobs: list[AsyncJob] = []

    async def post(self) -> None:
        body: Mapping[str, Any] = {}
        try:
            body = self.body_json()
            sub, _ = await self.gateway.served(self.endpoint.submission(body))
            await self.gateway.check_model(sub.model)
            if self.endpoint.encoder:
                await self.gateway.refuse_generator(sub.model)
            parts = split(sub, *await self.gateway.limits(sub.model))
            base = self.request_id(body).get("request_id") or new_request_id()
            for part, rid in zip(parts, part_ids(base, len(parts)), strict=True):
                self.jobs.append(await self.submit(part, body, rid))
            self.set_header("X-Request-Id", base)
            results = await self.gateway.results(self.jobs)
            if self.gone:
                return  # the client left (its request was cancelled)
            info = await self.gateway.model_info(sub.model)
            answered = Answered(f"{self.endpoint.id_prefix}-{base}", int(time.time()),
                                info.max_model_len if info is not None else None)  # fmt: skip
            result = merged(results)
            self.count_tokens(result)
            self.send_json(self.endpoint.answer(body, result, answered))
        except ApiError as exc:
            self._cancel_all()
            self.fail(exc)
        except BatchfleetError as exc:
            self._cancel_all()
            self.fail(of_exception(exc, body))

    def _cancel_all(self) -> None:
        """A part failed or the client left: the other parts are answered to nobody."""
        if len(self.jobs) > 1 or self.gone:
            for job in self.jobs:
                self.gateway.cancel(job)

    def on_connection_close(self) -> None:
        super().on_connection_close()
        if not self._finished:
            self._cancel_all()

    def on_finish(self) -> None:
        super().on_finish()
        for job in self.jobs:
            self.gateway.inflight.discard(job)


class Generate(Handler):
    """``/v1/chat/completions`` (``chat``) and ``/v1/completions``: whole, or streamed as
    server-sent events. A subclass serves another generation API by overriding the
    translations (:meth:`submission`, :meth:`answer`, :meth:`events`, :meth:`error_body`)
    and the stream's framing (:attr:`named`, :meth:`_write`, :meth:`_end`, :meth:`_end_with`)."""

    load_aware = True

    def initialize(self, gateway: Gateway, chat: bool) -> None:  # type: ignore[override]
        super().initialize(gateway)
        self.serves(chat)

    def serves(self, chat: bool) -> None:
        """What it answers: a chat (``chat``) or a text completion (``/invocations`` says
        once it read the body)."""
        self.chat = chat
        self.prefix = "chatcmpl-" if chat else "cmpl-"
        """Of the response's id."""
        self.named = False
        """Events written under their ``type`` (``event: <type>``), no ``[DONE]`` after
        them: the Responses and Messages APIs' streams (chunks are ``data:`` only)."""
        self.job: AsyncJob | None = None

    def submission(self, body: Mapping[str, Any]) -> Submission:
        make = openai_fields.chat_submission if self.chat else openai_fields.completion_submission
        return make(self._defaulted(body))

    def answer(self, body: Mapping[str, Any], result: Result, answered: Answered) -> Any:
        make = chat_response if self.chat else completion_response
        return make(self._defaulted(body), result, answered)

    def events(self, body: Mapping[str, Any], answered: Answered, model: str) -> Events:
        return Chunks(self._defaulted(body), answered, model, self.chat)

    def _defaulted(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.gateway.token_ids_default(body)

    async def expand(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The body to serve: as sent, here; the Responses API puts the stored
        conversation a ``previous_response_id`` continues in it."""
        return body

    async def detached(self, sub: Submission, body: Mapping[str, Any], alias: str | None) -> bool:
        """Answer without waiting for the result (True: answered): never, here; the
        Responses API's ``background`` does."""
        return False

    async def keep(self, answer: Any) -> None:
        """Called with the whole answer (streamed: the last events) before it is sent:
        nothing here; the Responses API stores it."""

    async def post(self) -> None:
        started = False
        body: Mapping[str, Any] = {}
        try:
            body = await self.expand(self.body_json())
            sub, alias = await self.gateway.served(self.submission(body))
            named = _named(alias)
            if await self.detached(sub, body, alias):
                return
            if not body.get("stream"):
                self.job = await self.submit(sub, body)
                answered = Answered(
                    f"{self.prefix}{self.job.id}",
                    int(time.time()),
                    sampling=await self.gateway.sampling(sub.model),
                    frontend=self.gateway.frontend,
                    system_fingerprint=await self.gateway.fingerprints.of(sub.model),
                )
                result = named(await self.gateway.replies.wait(self.job, self.gateway.timeout_s))
                if self.gone:
                    return
                if not result.ok:
                    raise of_result(result)
                self.count_tokens(result)
                answer = self.answer(body, result, answered)
                await self.keep(answer)
                return self.send_json(answer)
            rid = self.request_id(body).get("request_id") or new_request_id()
            with self.gateway.replies.stream(sub.model, rid):
                self.job = await self.submit(sub, body, rid)
                answered = Answered(
                    f"{self.prefix}{self.job.id}",
                    int(time.time()),
                    sampling=await self.gateway.sampling(sub.model),
                    frontend=self.gateway.frontend,
                    system_fingerprint=await self.gateway.fingerprints.of(sub.model),
                )
                chunks = self.events(body, answered, alias or self.job.model)
                async for event in self.gateway.replies.events(self.job, self.gateway.timeout_s):
                    if isinstance(event, Result):
                        event = named(event)
                        if not event.ok:
                            raise of_result(event)
                        self.count_tokens(event)
                        out = chunks.finish(event)
                        await self.keep(out)
                    else:
                        if isinstance(event, Restarted):
                            self.gateway.metrics.restarts.inc()
                        out = chunks.feed(event)
                    if out:
                        started = started or self._start()
                        self._write(out)
                    if started and not self.gateway.replies.backlog(rid):
                        await self._flush()
            self._end()
        except tornado.iostream.StreamClosedError:
            self._left()
        except Diverged as exc:
            self._left()
            self._end_with(ApiError(500, str(exc), code="stream_restarted"))
        except (ApiError, BatchfleetError) as exc:
            error = exc if isinstance(exc, ApiError) else of_exception(exc, body)
            if not started:
                return self.fail(error)
            self._end_with(error)

    def _start(self) -> bool:
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.gateway.metrics.first_event.labels(self.route).observe(self.request.request_time())
        return True

    def _write(self, chunks: list[dict[str, Any]]) -> None:
        if self.gone:
            raise tornado.iostream.StreamClosedError()
        if self.named:
            self.write("".join(f"event: {e['type']}\ndata: {dumps(e)}\n\n" for e in chunks))
        else:
            self.write("".join(f"data: {dumps(e)}\n\n" for e in chunks))

    async def _flush(self) -> None:
        """Send what was written (once the stream's delivered events are all written)."""
        if self.gone:
            raise tornado.iostream.StreamClosedError()
        await self.flush()

    def _end(self) -> None:
        """The stream is whole."""
        if not self.named:
            self.write("data: [DONE]\n\n")
        self.finish()

    def _end_with(self, error: ApiError) -> None:
        """A stream that already began ends with an error event (as vLLM's do)."""
        if self.gone:
            return
        self._write([self.error_body(error)])
        self._end()

    def _left(self) -> None:
        if self.job is not None and not self._finished:
            self.gateway.cancel(self.job)

    def on_connection_close(self) -> None:
        super().on_connection_close()
        self._left()


class NotFound(Handler):
    def prepare(self) -> None:
        super().prepare()
        if not self._finished:
            self.fail(ApiError(404, f"no route {self.request.method} {self.request.path}",
                               code="not_found"))  # fmt: skip


def make_app(
    gateway: Gateway,
    endpoints: Mapping[str, Endpoint] | None = None,
    *,
    cors: Cors | None = None,
    root_path: str = "",
) -> Any:
    """The tornado application: the generation routes (and their tokenizer's: vLLM's
    ``/tokenize`` and ``/detokenize``, Anthropic's ``count_tokens``), ``endpoints`` (path
    → unary endpoint: the pooling ones by default), models, health and vLLM's server
    routes (:mod:`.server_routes`); cross-origin requests as ``cors`` allows (None: no CORS
    headers), served at the root and under ``root_path`` (:class:`.serving.Rooted`)."""
    from .conversation_routes import (
        ConversationItem,
        ConversationItems,
        ConversationObject,
        Conversations,
    )
    from .messages import CountTokens, Messages  # imported here, as they import this module
    from .respond import CancelResponse, InputItems, Responses, StoredResponse
    from .server_routes import Invocations, Load, Ping, Version
    from .tokenization import COUNT_TOKENS, DETOKENIZE, TOKENIZE

    if endpoints is None:
        from .pooling import ENDPOINTS

        endpoints = ENDPOINTS
    g = {"gateway": gateway}
    routes: list[Any] = [
        (r"/v1/chat/completions", Generate, g | {"chat": True}),
        (r"/v1/completions", Generate, g | {"chat": False}),
        (r"/v1/responses", Responses, g),
        (r"/v1/responses/([^/]+)", StoredResponse, g),
        (r"/v1/responses/([^/]+)/input_items", InputItems, g),
        (r"/v1/responses/([^/]+)/cancel", CancelResponse, g),
        (r"/v1/conversations", Conversations, g),
        (r"/v1/conversations/([^/]+)", ConversationObject, g),
        (r"/v1/conversations/([^/]+)/items", ConversationItems, g),
        (r"/v1/conversations/([^/]+)/items/([^/]+)", ConversationItem, g),
        (r"/v1/messages", Messages, g),
        (r"/v1/messages/count_tokens", CountTokens, g | {"endpoint": COUNT_TOKENS}),
        (r"/tokenize", Unary, g | {"endpoint": TOKENIZE}),
        (r"/detokenize", Unary, g | {"endpoint": DETOKENIZE}),
        (r"/v1/models", Models, g),
        (r"/v1/models/([^/]+)", Models, g),
        (r"/invocations", Invocations, g),
        (r"/health", Health, g),
        (r"/livez", Health, g | {"deep": False}),
        (r"/ping", Ping, g),
        (r"/load", Load, g),
        (r"/version", Version, g),
        (r"/metrics", Metrics, g),
    ]
    routes += [(path, Unary, g | {"endpoint": ep}) for path, ep in endpoints.items()]
    if gateway.lora_admin is not None:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
        from .lora_admin import LoraRoute

        routes += [(r"/v1/load_lora_adapter", LoraRoute, g | {"load": True}),
                   (r"/v1/unload_lora_adapter", LoraRoute, g | {"load": False})]  # fmt: skip
    if gateway.frontend.tokenizer_info:  # vLLM's --enable-tokenizer-info-endpoint
        from .tokenizer_info import TokenizerInfo

        routes.append((r"/tokenizer_info", TokenizerInfo, g))
    if gateway.dev_admin is not None:  # vLLM's VLLM_SERVER_DEV_MODE
        from .dev_routes import ResetPrefixCache

        routes.append((r"/reset_prefix_cache", ResetPrefixCache, g))
    gateway.routes = frozenset(path for path, *_ in routes if "(" not in path)
    return Rooted(routes, root_path=root_path, cors=cors, default_handler_class=NotFound,
                  default_handler_args=g)  # fmt: skip


def redacted(url: str) -> str:
    """``url`` with its password masked (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


async def serve(
    url: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    timeout_s: float | None = 3600.0,
    priority: int | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    grace_s: float = 30.0,
    store_ttl_s: int = DEFAULT_TTL_S,
    store_max_bytes: int = DEFAULT_MAX_BYTES,
    conversations: Mapping[str, int] | None = None,
    lora_admin: LoraAdmin | None = None,
    dev_admin: DevAdmin | None = None,
    return_tokens_as_token_ids: bool = False,
    frontend: Frontend | None = None,
    uds: str | None = None,
    tls: Tls | None = None,
    cors: Cors | None = None,
    root_path: str = "",
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (or ``stop`` is set, or cancelled); then take no new
    request, give those in flight up to ``grace_s`` to end, and cancel those left, so the
    fleet stops generating for clients that will not be answered. ``ready`` is set once
    it listens and is subscribed to its reply channel. Responses API responses are stored
    ``store_ttl_s`` (0: none), up to ``store_max_bytes`` each; conversations as
    ``conversations`` says (:class:`~.conversations.ConversationStore`'s arguments).
    ``lora_admin``: serve vLLM's routes that load and unload LoRA adapters
    (:mod:`.lora_admin`); ``dev_admin``: its development routes (:mod:`.dev_routes`);
    ``return_tokens_as_token_ids``: the default of the requests' field (vLLM's flag);
    ``frontend``: vLLM's other switches of the answers, and ``/tokenizer_info``
    (:mod:`.frontend`).
    ``uds``: listen on this Unix socket instead of ``host:port``; ``tls``: speak HTTPS;
    ``cors``: answer cross-origin requests; ``root_path``: served under it too
    (:mod:`.serving`, :mod:`.cors`)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)  # the main thread's loop only
            handled.append(sig)
    async with AsyncProducer(url) as producer:
        gateway = Gateway(producer, api_key=api_key, timeout_s=timeout_s, priority=priority,
                          store_ttl_s=store_ttl_s, store_max_bytes=store_max_bytes,
                          conversations=conversations, lora_admin=lora_admin,
                          dev_admin=dev_admin,
                          return_tokens_as_token_ids=return_tokens_as_token_ids,
                          frontend=frontend)  # fmt: skip
        gateway.replies.start()
        app = make_app(gateway, cors=cors, root_path=root_path)
        server = listen(app, host=host, port=port, uds=uds, tls=tls, max_body_size=max_body,
                        idle_connection_timeout=3600)  # fmt: skip
        logger.info("OpenAI-compatible gateway on %s, its API at %s/v1 (fleet %s)",
                    server.address, root_path, redacted(producer.url))  # fmt: skip
        try:
            if ready is not None:
                await gateway.replies.subscribed.wait()
                ready.set()
            await stop.wait()
            gateway.stopping = True
            server.stop_accepting()
            end = time.monotonic() + grace_s
            while gateway.inflight and time.monotonic() < end:
                await asyncio.sleep(0.05)
            if gateway.inflight:
                logger.warning("stopping: cancelling %d requests still in flight",
                               len(gateway.inflight))  # fmt: skip
            for job in list(gateway.inflight):
                gateway.cancel(job)
        finally:
            server.close()
            await asyncio.gather(*gateway.pending, return_exceptions=True)
            await gateway.replies.close()
            for sig in handled:
                loop.remove_signal_handler(sig)
