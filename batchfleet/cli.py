"""``batchfleet`` command line: thin argument parsing over plain functions."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence


def _worker(args: argparse.Namespace) -> int:
    from .config import load_config
    from .worker.app import CELERY_QUEUE, create_app

    fleet = load_config(args.config)
    if args.name:
        fleet.worker.name = args.name
    app = create_app(fleet, models=args.model or None, burst=args.burst)
    name = args.name or f"batchfleet-{os.getpid()}"
    hostname = name if "@" in name else f"{name}@%h"
    argv = [
        "worker",
        "--pool=solo",
        f"--loglevel={args.loglevel}",
        f"--hostname={hostname}",
        f"--queues={CELERY_QUEUE}",
        "--without-mingle",
        "--without-gossip",
    ]
    app.worker_main(argv)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(requests=args.requests, rate=args.rate, redis_url=args.redis_url)


def _submit(args: argparse.Namespace) -> int:
    from .producer import Producer

    with Producer(args.redis_url) as producer:
        job = producer.submit(
            args.model, args.text, priority=args.priority, deadline_ms=args.deadline_ms
        )
        if not args.wait:
            print(job.id)
            return 0
        result = job.result(timeout=args.timeout)
        print(json.dumps(result.model_dump(mode="json", exclude_none=True), indent=2))
        return 0 if result.ok else 1


def _init_groups(args: argparse.Namespace) -> int:
    from .config import load_config
    from .groups import init_groups

    created = init_groups(load_config(args.config), args.model or None)
    for model, streams in created.items():
        print(f"{model}: {' '.join(streams)}")
    return 0


def _dlq(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import dlq
    from .connection import connect, default_url

    client = connect(args.redis_url or default_url())
    console = Console()
    ids = args.ids or None
    if args.action == "list":
        table = Table(title=f"dead letters of {args.model}")
        for col in ("id", "request", "code", "reason", "source", "worker"):
            table.add_column(col)
        for d in dlq.list_dead(client, args.model, args.count):
            table.add_row(d.id, d.request_id or "-", d.code, d.reason[:80], d.source, d.worker)
        console.print(table)
        return 0
    if ids is None and not args.all:
        console.print(f"name dead-letter ids, or --all, to {args.action}")
        return 2
    if args.action == "replay":
        report = dlq.replay(client, args.model, ids, force=args.force)
        console.print(f"replayed {len(report.replayed)}, skipped {len(report.skipped)} "
                      "(already answered; --force replaces their result)")  # fmt: skip
        return 0
    console.print(f"purged {dlq.purge(client, args.model, ids)}")
    return 0


def _simulate(args: argparse.Namespace, rest: list[str]) -> int:
    from .batching.simulate_cli import main as simulate_main

    return int(simulate_main(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchfleet", description="Micro-batched inference workers behind Redis streams."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run a worker (a Celery worker with batch loops)")
    w.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    w.add_argument("--model", "-m", action="append", help="serve only this model (repeatable)")
    w.add_argument("--name", "-n", help="Celery hostname / consumer name (unique per worker)")
    w.add_argument("--burst", action="store_true", help="exit once the streams are empty")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=_worker)

    d = sub.add_parser("demo", help="local Redis + a MiniLM worker + a producer, with a summary")
    d.add_argument("--requests", type=int, default=300)
    d.add_argument("--rate", type=float, default=40.0, help="submissions per second")
    d.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    d.set_defaults(func=_demo)

    s = sub.add_parser("submit", help="submit one request (and wait for its result)")
    s.add_argument("model")
    s.add_argument("text", nargs="+")
    s.add_argument("--priority", "-p", type=int, default=None)
    s.add_argument("--deadline-ms", type=int, default=None)
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=30.0)
    s.add_argument("--redis-url", default=None)
    s.set_defaults(func=_submit)

    g = sub.add_parser(
        "init-groups", help="create every model's consumer groups (deploy time; idempotent)"
    )
    g.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    g.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    g.set_defaults(func=_init_groups)

    q = sub.add_parser("dlq", help="inspect, replay or purge a model's dead letters")
    q.add_argument("action", choices=["list", "replay", "purge"])
    q.add_argument("model")
    q.add_argument("ids", nargs="*", help="dead-letter entry ids (default: none; see --all)")
    q.add_argument("--all", action="store_true", help="replay/purge every dead letter")
    q.add_argument("--force", action="store_true", help="replay even answered requests")
    q.add_argument("--count", type=int, default=100)
    q.add_argument("--redis-url", default=None)
    q.set_defaults(func=_dlq)

    sub.add_parser("simulate", help="run the batching simulator (see `simulate --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":
        return _simulate(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
