"""Compare ``batchfleet/vllm_catalog.py`` with the ``vllm serve`` parser of the vLLM installed
here: the flags vLLM takes that the catalog lacks (or lists with another number of
values), and the catalog's flags vLLM no longer takes. Run it when vLLM changes, in an
environment with vLLM (``pip install vllm``; no GPU needed: ``VLLM_TARGET_DEVICE=cpu``),
then add what it prints to the catalog and a meaning for each new flag to
``vllm_engine_flags.py``/``vllm_server_flags.py`` (the from-vllm tests say which lack one).

Usage: ``VLLM_TARGET_DEVICE=cpu python tools/vllm_catalog.py``; exit 1 where they differ.
"""

from __future__ import annotations

import sys
from typing import Any


def vllm_arities() -> dict[str, int | str]:
    """Each option string of vLLM's ``vllm serve`` parser and its values (0, 1, ``+``, ``?``),
    short forms as their long flag's."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sys.argv = ["vllm", "serve"]  # as `vllm serve` builds it (``--model`` included)
    parser = make_arg_parser(FlexibleArgumentParser())
    out: dict[str, int | str] = {}
    action: Any
    for opt, action in parser._option_string_actions.items():
        if action.dest == "help" or not opt.startswith("--"):
            continue
        nargs = action.nargs
        out[opt] = 0 if nargs == 0 else 1 if nargs is None else str(nargs)
    return out


def main() -> int:
    from batchfleet.vllm_catalog import ARITY, OLDER, SHORT

    ours = {**ARITY, **{k: ARITY[v] for k, v in SHORT.items() if k.startswith("--")}}
    theirs = vllm_arities()
    missing = {f: n for f, n in theirs.items() if ours.get(f) != n}
    gone = sorted(f for f in ours if f not in theirs and f not in OLDER)
    for flag, n in sorted(missing.items()):
        said = "lacks it" if flag not in ours else f"says {ours[flag]}"
        print(f"vLLM takes {flag} ({n} values): the catalog {said}")
    for flag in gone:
        print(f"the catalog lists {flag}: this vLLM does not take it (move it to OLDER?)")
    return 1 if missing or gone else 0


if __name__ == "__main__":
    raise SystemExit(main())
