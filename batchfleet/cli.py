"""``batchfleet`` command line: thin argument parsing over plain functions.

The entry point and the parser's wiring; each subcommand group's flags and handler are in
its own module (``cli_fleet``, ``cli_requests``, ``cli_webhooks``, ``cli_observe``,
``cli_gateway``, ``cli_run_batch``, ``cli_from_vllm``, ``cli_control``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import (
    cli_control,
    cli_fleet,
    cli_from_vllm,
    cli_gateway,
    cli_observe,
    cli_requests,
    cli_run_batch,
    cli_webhooks,
)


def _simulate(args: argparse.Namespace, rest: list[str]) -> int:
    from .batching.simulate_cli import main as simulate_main

    return int(simulate_main(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchfleet", description="Micro-batched inference workers behind Redis streams."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `batchfleet --help` lists them.
    cli_fleet.add_worker(sub)
    cli_fleet.add_demo(sub)
    cli_requests.add_submit(sub)
    cli_fleet.add_init_groups(sub)
    cli_requests.add_dlq(sub)
    cli_webhooks.add_webhooks(sub)
    sub.add_parser("simulate", help="run the batching simulator (see `simulate --help`)")
    cli_observe.add_status(sub)
    cli_requests.add_trace(sub)
    cli_observe.add_top(sub)
    cli_observe.add_flower(sub)
    cli_gateway.add_gateway(sub)
    cli_run_batch.add_run_batch(sub)
    cli_from_vllm.add_from_vllm(sub)
    cli_control.add_control(sub)
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
