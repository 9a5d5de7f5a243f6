"""`batchfleet gateway`: the OpenAI-compatible HTTP gateway's flags, and serving it."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING

from .cli_common import (
    add_heartbeat_window,
    add_where,
    broker_url_of,
    control_timeout,
    redis_url_of,
    window_ms,
)
from .gateway_flags import add_serving_flags

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _gateway(args: argparse.Namespace) -> int:
    import asyncio

    from .gateway_flags import serving_options
    from .producer.gateway.app import serve

    key = args.api_key or os.environ.get("BATCHFLEET_API_KEY") or None
    try:
        serving = serving_options(args)
    except ValueError as exc:
        print(f"batchfleet gateway: {exc}", file=sys.stderr)
        return 2
    lora_admin = dev_admin = None
    if args.allow_runtime_lora_updating or args.server_dev_mode:
        try:
            broker = args.broker_url or broker_url_of(args)
        except ValueError as exc:  # a Redis Cluster named, and no broker
            print(f"batchfleet gateway: {exc} (or pass --broker-url)", file=sys.stderr)
            return 2
        window = window_ms(args.heartbeat_window)
        if args.allow_runtime_lora_updating:
            from .producer.gateway.lora_admin import LoraAdmin

            lora_admin = LoraAdmin(broker, args.control_timeout, heartbeat_window_ms=window)
        if args.server_dev_mode:
            from .producer.gateway.dev_routes import DevAdmin

            dev_admin = DevAdmin(broker, args.control_timeout, heartbeat_window_ms=window)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(redis_url_of(args), host=args.host, port=args.port, api_key=key,
                          timeout_s=args.timeout or None, priority=args.priority,
                          grace_s=args.grace, store_ttl_s=args.responses_ttl,
                          store_max_bytes=args.responses_max_bytes,
                          conversations={"ttl_s": args.conversations_ttl,
                                         "max_items": args.conversations_max_items,
                                         "max_bytes": args.conversations_max_bytes},
                          lora_admin=lora_admin, dev_admin=dev_admin,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          **serving))  # fmt: skip
    return 0


# The stores' limits (--flag, default, help), all whole numbers; the defaults are the
# stores' own (stored.DEFAULT_*, conversations.DEFAULT_*), not imported: the CLI stays light.
_STORE_LIMITS: tuple[tuple[str, int, str], ...] = (
    ("--responses-ttl", 24 * 3600,
     "seconds a stored /v1/responses response is kept, up to 30 days (0: store none)"),
    ("--responses-max-bytes", 4 * 1024 * 1024,
     "a larger stored response (with its conversation) is answered but not stored"),
    ("--conversations-ttl", 30 * 24 * 3600,
     "seconds a /v1/conversations conversation is kept after its last change "
     "(default 30 days; 0: until deleted, as OpenAI's)"),
    ("--conversations-max-items", 1000,
     "the most items a conversation holds (adding more is refused with 400)"),
    ("--conversations-max-bytes", 4 * 1024 * 1024,
     "the most bytes a conversation's items hold, as JSON (more is refused with 400)"),
)  # fmt: skip


def _add_store_limits(gw: argparse.ArgumentParser) -> None:
    """How long, and how much, the gateway keeps of /v1/responses and /v1/conversations."""
    for flag, default, text in _STORE_LIMITS:
        gw.add_argument(flag, type=int, default=default, help=text)


def add_gateway(sub: Subparsers) -> None:
    """`gateway` and its flags (vLLM's, where it has one)."""
    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (/v1/...)")
    add_where(gw)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--api-key", help="clients must send it as a Bearer token (default "
                    "$BATCHFLEET_API_KEY; none: no key)")  # fmt: skip
    gw.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds a request may wait for its result or next token (0: no limit)",
    )
    gw.add_argument(
        "--priority",
        type=int,
        default=None,
        help="lane of requests that give no priority (default: the producer's, 1)",
    )
    gw.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the requests in flight get to end (then cancelled)",
    )
    _add_store_limits(gw)
    gw.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (a Celery "
        "broadcast to the fleet's workers, as load-lora; off: 404)",
    )
    gw.add_argument(
        "--server-dev-mode",
        action="store_true",
        help="serve vLLM's development routes (its VLLM_SERVER_DEV_MODE): POST "
        "/reset_prefix_cache, a Celery broadcast to the fleet's workers (off: 404)",
    )
    gw.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name each token 'token_id:{id}' (vLLM's flag): the default of the "
        "chat and completion requests' return_tokens_as_token_ids",
    )
    gw.add_argument(
        "--broker-url",
        help="where the workers listen for broadcasts, for those routes (default: --redis-url "
        "where it is not a Redis Cluster, else the fleet file's broker)",
    )
    gw.add_argument(
        "--control-timeout",
        "--lora-timeout",
        type=float,
        default=control_timeout(),
        help="seconds the LoRA and development routes wait for a reply from each live worker "
        "of the model; one that does not reply within it is named in the answer (504). "
        "Default $BATCHFLEET_CONTROL_TIMEOUT, else 30",
    )
    add_heartbeat_window(gw)
    add_serving_flags(gw)
    gw.set_defaults(func=_gateway)
