"""`batchfleet submit`, `trace` and `dlq`: one request sent, followed, or dead-lettered."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from .cli_common import add_where, redis_url_of

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _submit(args: argparse.Namespace) -> int:
    from .producer import Producer

    try:
        options = json.loads(args.options) if args.options else {}
    except json.JSONDecodeError as exc:
        print(f"--options is not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(options, dict):
        print("--options is a JSON object of request fields", file=sys.stderr)
        return 2
    if args.max_new_tokens is not None:
        options["max_new_tokens"] = args.max_new_tokens
    if args.stream:
        options["stream"] = True
    inputs: list[str] | None = args.text
    if args.chat:
        options["messages"] = [{"role": "user", "content": " ".join(args.text)}]
        inputs = None
    with Producer(args.redis_url) as producer:
        job = producer.submit(args.model, inputs, priority=args.priority,
                              deadline_ms=args.deadline_ms, **options)  # fmt: skip
        if args.stream:
            for piece in job.stream(timeout=args.timeout):
                print(piece, end="", flush=True)
            print()
        elif not args.wait:
            print(job.id)
            return 0
        result = job.result(timeout=args.timeout)
        print(json.dumps(result.model_dump(mode="json", exclude_none=True), indent=2))
        return 0 if result.ok else 1


def _trace(args: argparse.Namespace) -> int:
    from .connection import connect
    from .trace import render, trace

    client = connect(redis_url_of(args))
    try:
        found = trace(client, args.model, args.request_id, max_scan=args.max_scan)
    finally:
        client.close()
    print(json.dumps(found.to_json(), indent=2) if args.json else render(found))
    return 1 if found.state == "unknown" else 0


def _dlq(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import dlq
    from .connection import connect, default_url

    client = connect(args.redis_url or default_url())
    console = Console()
    ids = args.ids or None
    if args.action == "list":
        dead = dlq.list_dead(client, args.model, args.count)
        if args.json:
            print(json.dumps([d.to_json() for d in dead], indent=2))
            return 0
        table = Table(title=f"dead letters of {args.model}")
        for col in ("id", "request", "code", "reason", "source", "worker"):
            table.add_column(col, no_wrap=col == "id")
        for d in dead:
            table.add_row(d.id, d.request_id or "-", d.code, d.reason[:80], d.source, d.worker)
        console.print(table)
        return 0
    if ids is None and not args.all:
        console.print(f"name dead-letter ids, or --all, to {args.action}")
        return 2
    if args.action == "replay":
        report = dlq.replay(client, args.model, ids, force=args.force)
        print(f"replayed {len(report.replayed)}, skipped {len(report.skipped)} (already "
              f"answered; --force replaces their result), refused {len(report.refused)}")  # fmt: skip
        for dead_id, why in report.refused.items():
            print(f"  {dead_id} stays a dead letter: {why}")
        return 1 if report.refused else 0
    console.print(f"purged {dlq.purge(client, args.model, ids)}")
    return 0


def add_submit(sub: Subparsers) -> None:
    """`submit`: one request, its id or (``--wait``) its result."""
    s = sub.add_parser("submit", help="submit one request (and wait for its result)")
    s.add_argument("model")
    s.add_argument("text", nargs="+")
    s.add_argument("--priority", "-p", type=int, default=None)
    s.add_argument("--deadline-ms", type=int, default=None)
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=30.0)
    s.add_argument("--chat", action="store_true",
                   help="generation: the text is one user message (chat template)")  # fmt: skip
    s.add_argument(
        "--max-new-tokens", type=int, default=None, help="generation (0: none, the prompt only)"
    )
    s.add_argument("--stream", action="store_true",
                   help="generation: print the text as it streams, then the result")  # fmt: skip
    s.add_argument("--options", default=None,
                   help="other request fields as a JSON object, e.g. "
                        "'{\"temperature\": 0.7, \"structured_outputs\": {\"regex\": \"[0-9]+\"}}'")  # fmt: skip
    s.add_argument("--redis-url", default=None)
    s.set_defaults(func=_submit)


def add_trace(sub: Subparsers) -> None:
    """`trace`: where a request went, and what became of it."""
    tr = sub.add_parser("trace", help="a request's journey: lane, worker, batch, timings, result")
    add_where(tr)
    tr.add_argument("model")
    tr.add_argument("request_id")
    tr.add_argument("--json", action="store_true", help="one JSON document")
    tr.add_argument("--max-scan", type=int, default=100_000, help="entries searched per stream")
    tr.set_defaults(func=_trace)


def add_dlq(sub: Subparsers) -> None:
    """`dlq`: list, replay or purge a model's dead letters."""
    q = sub.add_parser("dlq", help="inspect, replay or purge a model's dead letters")
    q.add_argument("action", choices=["list", "replay", "purge"])
    q.add_argument("model")
    q.add_argument("ids", nargs="*", help="dead-letter entry ids (default: none; see --all)")
    q.add_argument("--all", action="store_true", help="replay/purge every dead letter")
    q.add_argument("--force", action="store_true", help="replay even answered requests")
    q.add_argument("--count", type=int, default=100)
    q.add_argument("--json", action="store_true", help="list: a JSON array (full ids)")
    q.add_argument("--redis-url", default=None)
    q.set_defaults(func=_dlq)
