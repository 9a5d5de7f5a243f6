"""`batchfleet run-batch`: a file of OpenAI batch requests answered through the fleet."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .cli_common import add_where, redis_url_of

if TYPE_CHECKING:
    from .cli_common import Subparsers


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
    return run(args.input_file, args.output_file, redis_url_of(args), settings, args.output_tmp_dir,
               metrics_at)  # fmt: skip


def add_run_batch(sub: Subparsers) -> None:
    """`run-batch` and its flags (vLLM's, where it has one)."""
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
    add_where(rb)
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
