"""`batchfleet gateway`'s store limits: the stores' own defaults, each flag its own int."""

from __future__ import annotations

from batchfleet.producer.gateway import conversations, stored

from batchfleet.cli import build_parser


def test_store_limit_defaults_are_the_stores_defaults() -> None:
    args = build_parser().parse_args(["gateway"])
    assert (args.responses_ttl, args.responses_max_bytes) == (
        stored.DEFAULT_TTL_S,
        stored.DEFAULT_MAX_BYTES,
    )
    assert (
        args.conversations_ttl,
        args.conversations_max_items,
        args.conversations_max_bytes,
    ) == (
        conversations.DEFAULT_TTL_S,
        conversations.DEFAULT_MAX_ITEMS,
        conversations.DEFAULT_MAX_BYTES,
    )


def test_each_store_limit_flag_sets_its_own_int() -> None:
    flags = ["--responses-ttl", "--responses-max-bytes", "--conversations-ttl",
             "--conversations-max-items", "--conversations-max-bytes"]  # fmt: skip
    argv = ["gateway"]
    for n, flag in enumerate(flags, start=1):
        argv += [flag, str(n)]
    args = build_parser().parse_args(argv)
    got = [getattr(args, flag[2:].replace("-", "_")) for flag in flags]
    assert got == [1, 2, 3, 4, 5]
