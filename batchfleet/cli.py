"""``batchfleet`` command line: thin argument parsing over plain functions."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .gateway_flags import add_serving_flags


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


def _trace(args: argparse.Namespace) -> int:
    from .connection import connect
    from .trace import render, trace

    client = connect(_url(args))
    try:
        found = trace(client, args.model, args.request_id, max_scan=args.max_scan)
    finally:
        client.close()
    print(json.dumps(found.to_json(), indent=2) if args.json else render(found))
    return 1 if found.state == "unknown" else 0


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


def _simulate(args: argparse.Namespace, rest: list[str]) -> int:
    from .batching.simulate_cli import main as simulate_main

    return int(simulate_main(rest))


def _status(args: argparse.Namespace) -> int:
    import redis

    from .status import print_status

    try:
        print_status(
            _url(args),
            args.model,
            workers=not args.no_workers,
            broker_url=_broker(args),
            as_json=args.json,
        )
    except redis.ConnectionError as exc:
        print(f"cannot reach Redis: {exc}", file=sys.stderr)
        return 1
    return 0


def _top(args: argparse.Namespace) -> int:
    from .status import top

    with contextlib.suppress(KeyboardInterrupt):
        top(_url(args), args.model, interval=args.interval, broker_url=_broker(args))
    return 0


def _flower(args: argparse.Namespace) -> int:
    env = dict(os.environ, FLOWER_UNAUTHENTICATED_API=os.environ.get(
        "FLOWER_UNAUTHENTICATED_API", "false"))  # fmt: skip
    if args.config:
        env["BATCHFLEET_CONFIG"] = os.path.abspath(args.config)
    if args.redis_url:
        env["REDIS_URL"] = args.redis_url
    # `python -m celery` of this interpreter: a venv's `celery` need not be on PATH
    argv = [sys.executable, "-m", "celery", "-A", "batchfleet.remote", "flower",
            f"--port={args.port}", f"--address={args.address}", *_flower_options(args.flower_args)]  # fmt: skip
    os.execve(sys.executable, argv, env)
    return 1  # not reached


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
    lora_admin = None
    if args.allow_runtime_lora_updating:
        from .producer.gateway.lora_admin import LoraAdmin

        lora_admin = LoraAdmin(args.broker_url or _broker(args), args.control_timeout,
                               heartbeat_window_ms=_window_ms(args.heartbeat_window))  # fmt: skip
    dev_admin = None
    if args.server_dev_mode:
        from .producer.gateway.dev_routes import DevAdmin

        dev_admin = DevAdmin(args.broker_url or _broker(args), args.control_timeout,
                             heartbeat_window_ms=_window_ms(args.heartbeat_window))  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(_url(args), host=args.host, port=args.port, api_key=key,
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


def _from_vllm(args: argparse.Namespace) -> int:
    from .from_vllm import from_vllm

    argv = list(args.vllm_args)
    code, out, err = from_vllm(argv[1:] if argv[:1] == ["--"] else argv, out=args.out,
                               keep_going=args.keep_going)  # fmt: skip
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


def _run_batch(args: argparse.Namespace) -> int:
    from .run_batch import Settings, run

    models: dict[str, str] = {}
    for pair in args.model_map or []:
        name, sep, model = pair.partition("=")
        if not (sep and name and model):
            print(f"--model-map takes NAME=MODEL, not {pair!r}", file=sys.stderr)
            return 2
        models[name] = model
    if args.max_in_flight < 1:
        print("--max-in-flight must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"--port must be 0 to 65535, not {args.port}", file=sys.stderr)
        return 2
    settings = Settings(max_in_flight=args.max_in_flight, timeout_s=args.timeout or None,
                        priority=args.priority, models=models, default_model=args.model,
                        response_role=args.response_role, progress_s=args.progress_interval)  # fmt: skip
    metrics_at = (args.url, args.port) if args.enable_metrics else None
    return run(args.input_file, args.output_file, _url(args), settings, args.output_tmp_dir,
               metrics_at)  # fmt: skip


def _flower_options(given: list[str]) -> list[str]:
    """Flower's own options: ``--enable_events=False`` unless given. Workers send task
    events from the start, and Flower's default broadcasts ``enable_events`` every 5 s,
    which would undo an operator's ``celery control disable_events``."""
    names = {arg.split("=", 1)[0].lstrip("-").replace("-", "_") for arg in given}
    return given if "enable_events" in names else ["--enable_events=False", *given]


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
    import redis

    from .connection import connect
    from .control_wait import addressed, broadcast, hostnames, live_workers
    from .fleetview import discover_models
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
        client = connect(_url(args))
        try:
            models = [args.model] if args.model else discover_models(client)
            live, window = live_workers(client, models, _window_ms(args.heartbeat_window))
            hosts = hostnames(client, models) if dest else {}
        finally:
            client.close()
    except redis.RedisError as exc:
        print(f"cannot read the workers' heartbeats: {exc}", file=sys.stderr)
        return 1
    expect, dest = addressed(live, hosts, dest) if dest else (live, dest)
    if not expect:
        who = f"worker named {', '.join(dest)}" if dest else "worker"
        print(f"no live {who} of {args.model or 'any model'} (none has a heartbeat within "
              f"{window / 1000:g} s): nothing sent", file=sys.stderr)  # fmt: skip
        return 1
    try:
        replies = broadcast(_broker(args), f"bf_{args.command.replace('-', '_')}", arguments,
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


def _window_ms(seconds: float | None) -> int | None:
    """``--heartbeat-window`` (seconds) in ms; None: the workers' published timeout."""
    return None if seconds is None else max(1, round(seconds * 1000))


def _url(args: argparse.Namespace) -> str:
    from .config import load_config

    if args.redis_url:
        return str(args.redis_url)
    return load_config(args.config).redis_url


def _broker(args: argparse.Namespace) -> str:
    """Where workers listen for broadcasts: ``--redis-url``, else the fleet's broker."""
    from .config import load_config

    if args.redis_url:
        return str(args.redis_url)
    return load_config(args.config).celery_broker_url()


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
    q.add_argument("--json", action="store_true", help="list: a JSON array (full ids)")
    q.add_argument("--redis-url", default=None)
    q.set_defaults(func=_dlq)
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

    sub.add_parser("simulate", help="run the batching simulator (see `simulate --help`)")

    def where(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config", "-c", help="fleet file (for redis_url); default $BATCHFLEET_CONFIG"
        )
        p.add_argument("--redis-url", default=None, help="overrides the fleet file's redis_url")

    st = sub.add_parser("status", help="streams, depth and lag per lane, workers (one table)")
    where(st)
    st.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    st.add_argument("--no-workers", action="store_true", help="skip `celery inspect stats`")
    st.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    st.set_defaults(func=_status)

    tr = sub.add_parser("trace", help="a request's journey: lane, worker, batch, timings, result")
    where(tr)
    tr.add_argument("model")
    tr.add_argument("request_id")
    tr.add_argument("--json", action="store_true", help="one JSON document")
    tr.add_argument("--max-scan", type=int, default=100_000, help="entries searched per stream")
    tr.set_defaults(func=_trace)

    tp = sub.add_parser("top", help="`status`, refreshed live (Ctrl-C to quit)")
    where(tp)
    tp.add_argument("--model", "-m", action="append", help="only this model (repeatable)")
    tp.add_argument("--interval", "-i", type=float, default=2.0, help="seconds between refreshes")
    tp.set_defaults(func=_top)

    fl = sub.add_parser("flower", help="run Flower on the fleet's broker")
    where(fl)
    fl.add_argument("--port", type=int, default=5555)
    fl.add_argument("--address", default="127.0.0.1")
    fl.add_argument("flower_args", nargs="*", help="passed to flower (after --)")
    fl.set_defaults(func=_flower)

    control_timeout = float(os.environ.get("BATCHFLEET_CONTROL_TIMEOUT") or 30.0)
    window = os.environ.get("BATCHFLEET_HEARTBEAT_WINDOW") or None
    window_help = (
        "seconds since its last heartbeat within which a worker is live, and waited for "
        "(default $BATCHFLEET_HEARTBEAT_WINDOW, else each model's heartbeat_timeout_ms as "
        "its workers publish it from their fleet file, else 6)"
    )
    gw = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (/v1/...)")
    where(gw)
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
    gw.add_argument(
        "--responses-ttl",
        type=int,
        default=24 * 3600,  # stored.DEFAULT_TTL_S (not imported: the CLI stays light)
        help="seconds a stored /v1/responses response is kept, up to 30 days (0: store none)",
    )
    gw.add_argument(
        "--responses-max-bytes",
        type=int,
        default=4 * 1024 * 1024,  # stored.DEFAULT_MAX_BYTES
        help="a larger stored response (with its conversation) is answered but not stored",
    )
    gw.add_argument(
        "--conversations-ttl",
        type=int,
        default=30 * 24 * 3600,  # conversations.DEFAULT_TTL_S
        help="seconds a /v1/conversations conversation is kept after its last change "
        "(default 30 days; 0: until deleted, as OpenAI's)",
    )
    gw.add_argument(
        "--conversations-max-items",
        type=int,
        default=1000,  # conversations.DEFAULT_MAX_ITEMS
        help="the most items a conversation holds (adding more is refused with 400)",
    )
    gw.add_argument(
        "--conversations-max-bytes",
        type=int,
        default=4 * 1024 * 1024,  # conversations.DEFAULT_MAX_BYTES
        help="the most bytes a conversation's items hold, as JSON (more is refused with 400)",
    )
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
        help="where the workers listen for broadcasts, for those routes (default: --redis-url, "
        "else the fleet file's broker)",
    )
    gw.add_argument(
        "--control-timeout",
        "--lora-timeout",
        type=float,
        default=control_timeout,
        help="seconds the LoRA and development routes wait for a reply from each live worker "
        "of the model; one that does not reply within it is named in the answer (504). "
        "Default $BATCHFLEET_CONTROL_TIMEOUT, else 30",
    )
    gw.add_argument("--heartbeat-window", type=float, default=window, help=window_help)
    add_serving_flags(gw)
    gw.set_defaults(func=_gateway)

    from .run_batch_metrics import DEFAULT_PORT, DEFAULT_URL

    rb = sub.add_parser(
        "run-batch",
        help="answer a file of OpenAI batch requests through the fleet (vLLM's run-batch)",
        description="Reads OpenAI's batch file format (one JSON request a line: custom_id, "
        "method POST, url, body), answers each line as the gateway answers its url "
        "(/v1/chat/completions, /v1/completions, /v1/embeddings, /pooling, /score, /rerank, "
        "/classify, ...), and writes one line per input line, in input order: {id, custom_id, "
        "response: {status_code, request_id, body}, error}. A bad line, an unknown url or "
        "model, a failed result: an error line, never a stopped run.",
        epilog="Exit status: 0 every line answered; 1 some lines are error lines, or Redis "
        "or the upload failed; 2 bad arguments, an unreadable input, or metrics that cannot "
        "be served; 130 stopped (Ctrl-C: the lines in flight cancelled in the fleet, the "
        "output holds the lines answered before, each whole).",
    )
    where(rb)
    rb.add_argument("-i", "--input-file", required=True,
                    help="a local file, - (stdin), or an http(s) URL (read with GET)")  # fmt: skip
    rb.add_argument("-o", "--output-file", required=True,
                    help="a local file, - (stdout), or an http(s) URL (uploaded with PUT "
                         "once whole)")  # fmt: skip
    rb.add_argument("--output-tmp-dir", default=None,
                    help="where an output for a URL is written before its upload (default: "
                         "the system's temporary directory)")  # fmt: skip
    rb.add_argument("--model-map", action="append", metavar="NAME=MODEL",
                    help="lines naming model NAME go to the fleet's MODEL (answers still name "
                         "NAME); repeatable")  # fmt: skip
    rb.add_argument("--model", default=None, help="the model of lines whose body names none")
    rb.add_argument("--max-in-flight", type=int, default=64,
                    help="lines being answered at once (default 64)")  # fmt: skip
    rb.add_argument("--timeout", type=float, default=3600.0,
                    help="seconds a line waits for its result (0: no limit); then it is "
                         "cancelled and answered 504")  # fmt: skip
    rb.add_argument("--priority", type=int, default=None,
                    help="lane of lines that set no priority (default: the producer's, 1; "
                         "e.g. 2 so interactive requests go first)")  # fmt: skip
    rb.add_argument("--response-role", default="assistant",
                    help="a chat answer's role (vLLM's flag)")  # fmt: skip
    rb.add_argument("--progress-interval", type=float, default=5.0,
                    help="seconds between progress lines on stderr, and one when the run "
                         "ends (0: none)")  # fmt: skip
    rb.add_argument("--enable-metrics", action="store_true",
                    help="serve run-batch's Prometheus metrics at --url:--port while the run "
                         "lasts (vLLM's flag)")  # fmt: skip
    rb.add_argument("--url", default=DEFAULT_URL,
                    help=f"the metrics server's address (default {DEFAULT_URL})")  # fmt: skip
    rb.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help=f"the metrics server's port (default {DEFAULT_PORT})")  # fmt: skip
    rb.set_defaults(func=_run_batch)

    fv = sub.add_parser(
        "from-vllm",
        help="a `vllm serve` (or `vllm run-batch`) command line as a fleet file and a "
        "gateway (or run-batch) command",
        description="Reads a `vllm serve` command line (after --; `vllm serve` optional, "
        "`--config FILE.yaml` read as vLLM reads it) and writes the fleet file serving the "
        "model, each line citing its vLLM flag, and the `batchfleet gateway` command; a "
        "`vllm run-batch` command line gives the `batchfleet run-batch` command. Flags "
        "with no equivalent are listed with why; unknown flags exit 2 unless --keep-going. "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING and VLLM_SERVER_DEV_MODE are read from the "
        "environment, as vLLM reads them.",
    )
    fv.add_argument("--out", "-o", help="write the fleet file here (default: stdout)")
    fv.add_argument("--keep-going", action="store_true",
                    help="write the file without unknown flags (each named in a comment)")  # fmt: skip
    fv.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        help="-- vllm serve MODEL [flags] | -- vllm run-batch -i IN -o OUT --model MODEL [flags]",
    )
    fv.set_defaults(func=_from_vllm)

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
        where(c)
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
        c.add_argument("--timeout", type=float, default=control_timeout,
                       help="seconds to wait for a reply from each live worker concerned (ended "
                            "once all replied); default $BATCHFLEET_CONTROL_TIMEOUT, else 30")  # fmt: skip
        c.add_argument("--heartbeat-window", type=float, default=window, help=window_help)
        c.set_defaults(func=_control)
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
