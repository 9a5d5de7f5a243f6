"""Control commands (`pause`, `resume`, `drain`, `policy`, `load-lora`, `unload-lora`,
`reset-prefix-cache`): a broadcast to the live workers, waiting for each one's reply."""

from __future__ import annotations

import argparse
import json
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

if TYPE_CHECKING:
    from .cli_common import Subparsers


CONTROL_EPILOG = (
    "Waits for a reply from each live worker concerned (its heartbeat within the fleet's "
    "heartbeat_timeout_ms, as its workers publish it, else 6 s; --heartbeat-window "
    "overrides), until all replied or none came for --timeout. Exit status: 0 each did it; 1 one refused, none "
    "is live, or Redis or the broker failed; 2 bad arguments; 3 some did not reply in time "
    "(named; they may still do it)."
)


def _control(args: argparse.Namespace) -> int:
    """A control command, to each live worker of the model (of every model, where none is
    named; of those ``-d`` names): exit 0 where each did it, 1 where one refused or none
    is live, 3 where some did not reply within ``--timeout`` (named; they may still do it)."""
    from .connection import connect
    from .control_wait import addressed, broadcast, hostnames, live_workers
    from .fleetview import discover_models
    from .redis_errors import FAILED_CALL
    from .remote import parse_settings

    arguments: dict[str, object] = {"model": args.model}
    if args.command == "policy":
        try:
            parse_settings(args.settings)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        arguments["settings"] = args.settings
    if args.command in ("load-lora", "unload-lora"):
        arguments["name"] = args.name
    if args.command == "load-lora":
        arguments["path"] = args.path
    dest = args.destination or []
    try:
        broker_url = broker_url_of(args)
    except ValueError as exc:  # a Redis Cluster named, and no broker
        print(exc, file=sys.stderr)
        return 2
    try:
        client = connect(redis_url_of(args))
        try:
            models = [args.model] if args.model else discover_models(client)
            live, window = live_workers(client, models, window_ms(args.heartbeat_window))
            hosts = hostnames(client, models) if dest else {}
        finally:
            client.close()
    except FAILED_CALL as exc:  # a cluster's failures are not redis.RedisError
        print(f"cannot read the workers' heartbeats: {exc}", file=sys.stderr)
        return 1
    expect, dest = addressed(live, hosts, dest) if dest else (live, dest)
    if not expect:
        who = f"worker named {', '.join(dest)}" if dest else "worker"
        print(f"no live {who} of {args.model or 'any model'} (none has a heartbeat within "
              f"{window / 1000:g} s): nothing sent", file=sys.stderr)  # fmt: skip
        return 1
    try:
        replies = broadcast(broker_url, f"bf_{args.command.replace('-', '_')}", arguments,
                            expect, timeout=args.timeout, destination=dest)  # fmt: skip
    except Exception as exc:  # kombu's and redis' errors alike: the broker's side
        print(f"the broker failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    mine = replies.mine(lambda r: bool(r.get("models")) and args.model in (None, *r["models"]))
    for host, reply in sorted(mine.items()):
        print(f"{host}: {json.dumps(reply)}")
    refused = [r for r in mine.values() if "error" in r]
    if args.command == "unload-lora" and len(refused) < len(mine):
        refused = [r for r in refused if r.get("code") != "not_loaded"]  # others unloaded it
    if replies.missing:
        print(f"{replies.late_note()} (busy, or stopped without a heartbeat yet): they may "
              "still do it", file=sys.stderr)  # fmt: skip
    return 1 if refused else 3 if replies.missing else 0


def add_control(sub: Subparsers) -> None:
    """One subcommand per control command."""
    timeout = control_timeout()
    for name, text in (
        ("pause", "stop reading new requests (held ones are still answered)"),
        ("resume", "resume reading after pause"),
        ("drain", "answer what is held, then stop; the worker exits when all its models are"),
        ("policy", "change batch policy knobs live: policy MODEL key=value ..."),
        ("load-lora", "load a LoRA adapter while serving: load-lora MODEL NAME PATH"),
        ("unload-lora", "unload a LoRA adapter: unload-lora MODEL NAME"),
        ("reset-prefix-cache", "empty the prefix caches of generating models"),
    ):
        c = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}.",
                           epilog=CONTROL_EPILOG)  # fmt: skip
        add_where(c)
        named = name in ("policy", "load-lora", "unload-lora")
        c.add_argument("model", nargs=None if named else "?", help="model (default all)")
        if name == "policy":
            c.add_argument("settings", nargs="+", help="e.g. max_batch_size=8 max_wait_ms=2")
        if name in ("load-lora", "unload-lora"):
            c.add_argument("name", help="the adapter's name (a request's `lora`)")
        if name == "load-lora":
            c.add_argument("path", help="its directory on the workers' hosts (PEFT's files)")
        c.add_argument("--destination", "-d", action="append",
                       help="only this worker: hostname (NAME@HOST) or name, as `status` shows")  # fmt: skip
        c.add_argument("--timeout", type=float, default=timeout,
                       help="seconds to wait for a reply from each live worker concerned (ended "
                            "once all replied); default $BATCHFLEET_CONTROL_TIMEOUT, else 30")  # fmt: skip
        add_heartbeat_window(c)
        c.set_defaults(func=_control)
