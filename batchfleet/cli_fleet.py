"""`batchfleet worker`, `demo` and `init-groups`: running and setting up the fleet."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _worker(args: argparse.Namespace) -> int:
    from .config import load_config
    from .worker.app import CELERY_QUEUE, create_app

    fleet = load_config(args.config)
    if args.name:
        fleet.worker.name = args.name
    app = create_app(fleet, models=args.model or None, burst=args.burst)
    # The Celery hostname carries the consumer name (`--name`, else the fleet file's
    # `[worker] name`): control replies, `-d` and `status` then know the worker by one name.
    name = fleet.worker.name or f"batchfleet-{os.getpid()}"
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

    return run_demo(
        requests=args.requests, rate=args.rate, redis_url=args.redis_url, llm=not args.no_llm
    )


def _init_groups(args: argparse.Namespace) -> int:
    from .config import load_config
    from .groups import init_groups

    created = init_groups(load_config(args.config), args.model or None)
    for model, streams in created.items():
        print(f"{model}: {' '.join(streams)}")
    return 0


def add_worker(sub: Subparsers) -> None:
    w = sub.add_parser("worker", help="run a worker (a Celery worker with batch loops)")
    w.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    w.add_argument("--model", "-m", action="append", help="serve only this model (repeatable)")
    w.add_argument("--name", "-n", help="Celery hostname / consumer name (unique per worker)")
    w.add_argument("--burst", action="store_true", help="exit once the streams are empty")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=_worker)


def add_demo(sub: Subparsers) -> None:
    d = sub.add_parser(
        "demo",
        help="local Redis + a MiniLM worker + a producer, with a summary; then SmolLM2 "
        "streams answers",
    )
    d.add_argument("--requests", type=int, default=300)
    d.add_argument("--rate", type=float, default=40.0, help="submissions per second")
    d.add_argument("--no-llm", action="store_true", help="skip the text-generation part (SmolLM2)")
    d.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    d.set_defaults(func=_demo)


def add_init_groups(sub: Subparsers) -> None:
    g = sub.add_parser(
        "init-groups", help="create every model's consumer groups (deploy time; idempotent)"
    )
    g.add_argument("--config", "-c", help="fleet file (TOML); default $BATCHFLEET_CONFIG")
    g.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    g.set_defaults(func=_init_groups)
