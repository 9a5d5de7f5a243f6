"""What several `batchfleet` subcommands share: where the fleet's Redis and broker are,
and the heartbeat window and reply timeout of the commands that wait on workers."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

WINDOW_HELP = (
    "seconds since its last heartbeat within which a worker is live, and waited for "
    "(default $BATCHFLEET_HEARTBEAT_WINDOW, else each model's heartbeat_timeout_ms as "
    "its workers publish it from their fleet file, else 6)"
)


def add_where(p: argparse.ArgumentParser) -> None:
    """``--config`` and ``--redis-url``: where the fleet's Redis is."""
    p.add_argument("--config", "-c", help="fleet file (for redis_url); default $BATCHFLEET_CONFIG")
    p.add_argument("--redis-url", default=None, help="overrides the fleet file's redis_url")


def add_heartbeat_window(p: argparse.ArgumentParser) -> None:
    """``--heartbeat-window``: which workers are live, and so waited for."""
    window = os.environ.get("BATCHFLEET_HEARTBEAT_WINDOW") or None
    p.add_argument("--heartbeat-window", type=float, default=window, help=WINDOW_HELP)


def control_timeout() -> float:
    """How long a control command waits for each reply: $BATCHFLEET_CONTROL_TIMEOUT, else 30 s."""
    return float(os.environ.get("BATCHFLEET_CONTROL_TIMEOUT") or 30.0)


def window_ms(seconds: float | None) -> int | None:
    """``--heartbeat-window`` (seconds) in ms; None: the workers' published timeout."""
    return None if seconds is None else max(1, round(seconds * 1000))


def redis_url_of(args: argparse.Namespace) -> str:
    """The fleet's Redis: ``--redis-url``, else the fleet file's."""
    from .config import load_config

    if args.redis_url:
        return str(args.redis_url)
    return load_config(args.config).redis_url


def broker_url_of(args: argparse.Namespace) -> str:
    """Where workers listen for broadcasts: ``--redis-url``, else the fleet's broker (the
    fleet file's or ``$BATCHFLEET_BROKER_URL``: a Redis Cluster ``--redis-url`` cannot be
    Celery's broker). Raises :class:`~batchfleet.schemas.errors.ConfigError` (a ValueError)
    where the fleet's Redis is a cluster and no broker is given."""
    from .config import load_config
    from .connection import is_cluster_url

    if args.redis_url and not is_cluster_url(args.redis_url):
        return str(args.redis_url)
    overrides = {"redis_url": args.redis_url} if args.redis_url else {}
    return load_config(args.config, **overrides).celery_broker_url()
