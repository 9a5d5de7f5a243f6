"""`batchfleet webhooks ...`: the webhooks worker, failed deliveries, disabled URLs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _webhooks_worker(args: argparse.Namespace) -> int:
    from .config import load_config
    from .webhooks.worker import run_worker

    fleet = load_config(args.config)
    return run_worker(fleet, name=args.name, concurrency=args.concurrency, loglevel=args.loglevel)


def _webhooks_list_failed(args: argparse.Namespace) -> int:
    from .config import load_config
    from .connection import connect
    from .webhooks.deadletter import list_failed

    fleet = load_config(args.config)
    client = connect(fleet.redis_url)
    found = 0
    for record in list_failed(client, count=args.count):
        print(json.dumps(record.summary()))
        found += 1
    if not found:
        print("no failed webhook deliveries", file=sys.stderr)
    return 0


def _webhooks_redeliver(args: argparse.Namespace) -> int:
    from .config import load_config
    from .connection import connect
    from .remote import client_app
    from .webhooks.deadletter import redeliver

    fleet = load_config(args.config)
    if not args.ids and not args.all:
        print("give record ids (from list-failed) or --all", file=sys.stderr)
        return 2
    with client_app(fleet.celery_broker_url()) as app:
        queued = redeliver(connect(fleet.redis_url), app, args.ids, count=args.count)
    for record_id in queued:
        print(record_id)
    missing = len(args.ids) - len(queued) if args.ids else 0
    print(f"queued {len(queued)} redeliveries", file=sys.stderr)
    return 1 if missing else 0


def _webhooks_client(args: argparse.Namespace) -> Any:
    from .config import load_config
    from .connection import connect

    return connect(load_config(args.config).redis_url)


def _webhooks_status(args: argparse.Namespace) -> int:
    from .webhooks.status import webhook_status

    found = webhook_status(_webhooks_client(args), args.model, args.id)
    if found is None:
        print("no webhook status: not attempted yet, no webhook, or expired", file=sys.stderr)
        return 1
    print(found.model_dump_json(indent=2))
    return 0


def _webhooks_disabled(args: argparse.Namespace) -> int:
    from .webhooks.endpoints import list_disabled

    for endpoint in list_disabled(_webhooks_client(args)):
        print(json.dumps(endpoint.summary()))
    return 0


def _webhooks_enable(args: argparse.Namespace) -> int:
    from .webhooks.endpoints import enable

    if not args.urls and not args.all:
        print("give URLs (from `webhooks disabled`) or --all", file=sys.stderr)
        return 2
    enabled = enable(_webhooks_client(args), args.urls or None)
    for url in enabled:
        print(url)
    print(f"re-enabled {len(enabled)} URLs", file=sys.stderr)
    return 1 if args.urls and len(enabled) < len(args.urls) else 0


def add_webhooks(sub: Subparsers) -> None:
    """`webhooks` and its subcommands."""
    h = sub.add_parser("webhooks", help="webhook delivery: worker, failed deliveries")
    hsub = h.add_subparsers(dest="webhooks_command", required=True)
    hw = hsub.add_parser("worker", help="run a webhooks worker (CPU Celery worker, threads)")
    hw.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    hw.add_argument("--name", "-n", help="Celery hostname (unique per worker)")
    hw.add_argument("--concurrency", type=int, default=None, help="deliveries in flight")
    hw.add_argument("--loglevel", default="INFO")
    hw.set_defaults(func=_webhooks_worker)
    hl = hsub.add_parser("list-failed", help="print failed deliveries, one JSON line each")
    hl.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    hl.add_argument("--count", type=int, default=100)
    hl.set_defaults(func=_webhooks_list_failed)
    hr = hsub.add_parser("redeliver", help="queue failed deliveries again (same webhook-id)")
    hr.add_argument("ids", nargs="*", help="record ids from list-failed")
    hr.add_argument("--all", action="store_true", help="the oldest --count records")
    hr.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    hr.add_argument("--count", type=int, default=100)
    hr.set_defaults(func=_webhooks_redeliver)
    hs = hsub.add_parser("status", help="where a request's webhook delivery stands (JSON)")
    hs.add_argument("model")
    hs.add_argument("id", help="request id")
    hs.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    hs.set_defaults(func=_webhooks_status)
    hd = hsub.add_parser("disabled", help="URLs disabled after a 410 Gone, one JSON line each")
    hd.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    hd.set_defaults(func=_webhooks_disabled)
    he = hsub.add_parser("enable", help="re-enable disabled URLs (gave-up deliveries: redeliver)")
    he.add_argument("urls", nargs="*", help="URLs from `webhooks disabled`")
    he.add_argument("--all", action="store_true", help="every disabled URL")
    he.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    he.set_defaults(func=_webhooks_enable)
