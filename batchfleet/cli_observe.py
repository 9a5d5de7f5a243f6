"""`batchfleet status`, `top` and `flower`: watching the fleet."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING

from .cli_common import add_where, broker_url_of, redis_url_of

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _status(args: argparse.Namespace) -> int:
    from .redis_errors import FAILED_CALL
    from .status import print_status

    broker_url = None if args.no_workers else _broker_or_none(args)
    try:
        print_status(
            redis_url_of(args),
            args.model,
            workers=broker_url is not None,
            broker_url=broker_url,
            as_json=args.json,
        )
    except FAILED_CALL as exc:  # a cluster's failures are not redis.RedisError
        print(f"cannot reach Redis: {exc}", file=sys.stderr)
        return 1
    return 0


def _top(args: argparse.Namespace) -> int:
    from .redis_errors import FAILED_CALL
    from .top import top

    with contextlib.suppress(KeyboardInterrupt):
        broker_url = _broker_or_none(args)
        try:
            top(redis_url_of(args), args.model, interval=args.interval, timeout=args.timeout,
                workers=broker_url is not None, broker_url=broker_url)  # fmt: skip
        except FAILED_CALL as exc:  # its first read (later ones are shown, not raised)
            print(f"cannot reach Redis: {exc}", file=sys.stderr)
            return 1
    return 0


def _broker_or_none(args: argparse.Namespace) -> str | None:
    """The fleet's broker, for the workers' ``inspect stats``; None (said on stderr) where
    the fleet's Redis is a cluster and no broker is given: the queues from Redis alone."""
    try:
        return broker_url_of(args)
    except ValueError as exc:
        print(f"{exc}; workers shown from their heartbeats alone", file=sys.stderr)
        return None


def _flower(args: argparse.Namespace) -> int:
    env = dict(os.environ, FLOWER_UNAUTHENTICATED_API=os.environ.get(
        "FLOWER_UNAUTHENTICATED_API", "false"))  # fmt: skip
    if args.config:
        env["BATCHFLEET_CONFIG"] = os.path.abspath(args.config)
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    # `python -m celery` of this interpreter: a venv's `celery` need not be on PATH
    argv = [sys.executable, "-m", "celery", "-A", "batchfleet.remote", "flower",
            f"--port={args.port}", f"--address={args.address}", *flower_options(args.flower_args)]  # fmt: skip
    os.execve(sys.executable, argv, env)
    return 1  # not reached


def flower_options(given: list[str]) -> list[str]:
    """Flower's own options: ``--enable_events=False`` unless given. Workers send task
    events from the start, and Flower's default broadcasts ``enable_events`` every 5 s,
    which would undo an operator's ``celery control disable_events``."""
    names = {arg.split("=", 1)[0].lstrip("-").replace("-", "_") for arg in given}
    return given if "enable_events" in names else ["--enable_events=False", *given]


def add_status(sub: Subparsers) -> None:
    """`status`: streams, lanes and workers, once."""
    st = sub.add_parser("status", help="streams, depth and lag per lane, workers (one table)")
    add_where(st)
    st.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    st.add_argument("--no-workers", action="store_true", help="skip `celery inspect stats`")
    st.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    st.set_defaults(func=_status)


def add_top(sub: Subparsers) -> None:
    """`top`: `status`, refreshed."""
    tp = sub.add_parser("top", help="`status`, refreshed live (Ctrl-C to quit)")
    add_where(tp)
    tp.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    tp.add_argument("--interval", "-i", type=float, default=2.0, help="seconds between refreshes")
    tp.add_argument("--timeout", type=float, default=5.0,
                    help="seconds a refresh waits for Redis (past it, the last tables stay, "
                         "marked)")  # fmt: skip
    tp.set_defaults(func=_top)


def add_flower(sub: Subparsers) -> None:
    """`flower`: Flower on the fleet's broker."""
    fl = sub.add_parser("flower", help="run Flower on the fleet's broker")
    add_where(fl)
    fl.add_argument("--port", type=int, default=5555)
    fl.add_argument("--address", default="127.0.0.1")
    fl.add_argument("flower_args", nargs="*", help="passed to flower (after --)")
    fl.set_defaults(func=_flower)
