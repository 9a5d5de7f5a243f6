"""`batchfleet from-vllm`: a `vllm serve` (or `vllm run-batch`) command line translated."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cli_common import Subparsers


def _from_vllm(args: argparse.Namespace) -> int:
    from .from_vllm import from_vllm

    argv = list(args.vllm_args)
    code, out, err = from_vllm(argv[1:] if argv[:1] == ["--"] else argv, out=args.out,
                               keep_going=args.keep_going)  # fmt: skip
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


def add_from_vllm(sub: Subparsers) -> None:
    """`from-vllm`."""
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
