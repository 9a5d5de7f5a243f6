"""The gateway's tornado application: its route table (:func:`make_app`), and serving it
(:func:`serve`) until a signal, with a graceful stop.

Each HTTP request becomes one fleet request through one shared :class:`AsyncProducer`:
the gateway holds no model and no queue of its own, so any number of gateways can stand
in front of one fleet. What the handlers share is the :class:`~.state.Gateway`; their
base is :mod:`.handler`, the generation routes :mod:`.generate`, the unary ones
:mod:`.unary`, models, health and metrics :mod:`.info_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from ..aio import AsyncProducer
from .cors import Cors
from .endpoint import Endpoint
from .frontend import Frontend
from .generate import Generate
from .handler import Handler, chosen_request_id, dumps
from .info_routes import Health, Metrics, Models, NotFound
from .serving import Rooted, Tls, listen
from .state import Gateway
from .stored import DEFAULT_MAX_BYTES, DEFAULT_TTL_S
from .unary import Unary

if TYPE_CHECKING:
    from .dev_routes import DevAdmin
    from .lora_admin import LoraAdmin

__all__ = ["Gateway", "Generate", "Handler", "Health", "Unary", "chosen_request_id", "dumps",
           "make_app", "redacted", "serve"]  # fmt: skip
"""Also what callers imported from here before its handlers had modules of their own."""

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 32 * 1024 * 1024


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
    from .messages import CountTokens, Messages  # here: route modules may import this one
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
