"""``batchfleet from-vllm`` for a ``vllm run-batch`` command line: its engine flags become
the fleet file as ``vllm serve``'s do (:mod:`.from_vllm`), and its own flags (vLLM's
``run_batch.make_arg_parser``) the ``batchfleet run-batch`` command answering the same
file through the fleet, or are listed with why they need nothing or have no equivalent.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from .vllm_args import Flag, VllmArgsError, read_serve
from .vllm_catalog import ARITY as ENGINE_ARITY
from .vllm_catalog import SHORT as ENGINE_SHORT
from .vllm_conversion import Conversion

ARITY = {"--input-file": 1, "--output-file": 1, "--output-tmp-dir": 1, "--response-role": 1,
         "--max-log-len": 1, "--enable-metrics": 0, "--url": 1, "--port": 1,
         "--enable-prompt-tokens-details": 0, "--enable-force-include-usage": 0}  # fmt: skip
"""The flags vLLM's run-batch adds to its engine flags, and how many values each takes."""
SHORT = {"-i": "--input-file", "-o": "--output-file"}
CARRIED = ("--input-file", "--output-file", "--output-tmp-dir", "--response-role",
           "--enable-metrics", "--url", "--port")  # fmt: skip
"""Taken by ``batchfleet run-batch`` under the same name, with the same meaning (the
metrics served are run-batch's own: :mod:`.run_batch_metrics`)."""
NEEDLESS = {
    "--max-log-len": "batchfleet run-batch does not log prompts",
    "--enable-prompt-tokens-details": "usage carries prompt_tokens_details.cached_tokens "
    "wherever the worker reports it",
    "--enable-force-include-usage": "a batch line's answer is whole, and carries its usage",
}


def is_run_batch(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a ``vllm run-batch`` (or ``run-batch``) command line."""
    return list(argv[:2]) == ["vllm", "run-batch"] or list(argv[:1]) == ["run-batch"]


@dataclass(slots=True)
class RunBatchArgs:
    """A ``vllm run-batch`` command line: its own flags, and the engine flags (with
    ``--model``) left for the ``vllm serve`` reader."""

    flags: dict[str, Flag] = field(default_factory=dict)
    engine: list[str] = field(default_factory=list)


def read_run_batch(argv: Sequence[str]) -> RunBatchArgs:
    """``argv`` split into run-batch's flags and the engine's (a :class:`VllmArgsError`
    where a flag lacks its value or ``-i``/``-o`` is missing, as vLLM requires both)."""
    args = list(argv[2:] if list(argv[:1]) == ["vllm"] else argv[1:])
    out = RunBatchArgs()
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline = token.partition("=")
        name = own_name(name)
        if name not in ARITY:
            out.engine.append(token)
            i += 1
            continue
        takes = ARITY[name]
        if eq:
            values: tuple[str, ...] = (inline,)
        else:
            values = tuple(args[i + 1 : i + 1 + takes])
            if len(values) < takes:
                raise VllmArgsError(f"{token}: expected one value")
        out.flags[name] = Flag(name, values)
        i += 1 + (0 if eq else takes)
    for short, need in SHORT.items():
        if need not in out.flags:
            raise VllmArgsError(f"vllm run-batch needs {short}/{need}, as vLLM does")
    return out


def own_name(name: str) -> str:
    """``name`` as run-batch's own flag it stands for (``-i``; ``_`` for ``-``; a prefix
    of one flag only, as argparse matches it among run-batch's and the engine's flags:
    ``--output-tmp`` for ``--output-tmp-dir``), else as given (an engine flag's); a
    :class:`VllmArgsError` where it begins several, in argparse's words."""
    if not name.startswith("--"):
        return SHORT.get(name, name)
    name = re.sub(r"(?<=\w)_", "-", name)
    names = {*ARITY, *ENGINE_ARITY, *ENGINE_SHORT.values(), "--model", "--config"}
    matches = sorted(n for n in names if n.startswith(name))
    if name in names or not matches:
        return name
    if len(matches) > 1:
        raise VllmArgsError(f"ambiguous option: {name} could match {', '.join(matches)}")
    return matches[0]  # (an engine flag's: left to the engine's reader)


def settle(job: RunBatchArgs, conv: Conversion) -> None:
    """Run-batch's own flags listed where they need nothing or have no equivalent; the
    notes on model names other than the fleet's dropped (:func:`command` maps them)."""
    for name, flag in job.flags.items():
        if name in NEEDLESS:
            conv.judged(flag, True, NEEDLESS[name])
    mapped = ("the model name ", "--served-model-name")
    conv.unsupported = [u for u in conv.unsupported if not u.startswith(mapped)]
    for args in conv.gateway:
        if args[0] != "--host":  # from-vllm's default: vLLM's run-batch serves nothing
            conv.unsupported.append(f"{args[0]}: a server flag, and run-batch is not served "
                                    "(vLLM's run-batch does not take it)")  # fmt: skip


def command(job: RunBatchArgs, conv: Conversion, fleet_path: str) -> str:
    """The ``batchfleet run-batch`` command answering the same file: lines naming a
    served name (vLLM's ``--served-model-name``, else ``--model``) or none go to the
    fleet's model."""
    argv = ["batchfleet", "run-batch", "--config", fleet_path]
    for name in CARRIED:
        if name not in job.flags:
            continue
        argv += [name, *job.flags[name].values]  # (--enable-metrics: none)
    argv += ["--model", conv.name]
    for served in served_names(job):
        if served != conv.name:
            argv += ["--model-map", f"{served}={conv.name}"]
    return shlex.join(argv)


def served_names(job: RunBatchArgs) -> list[str]:
    """The names vLLM's run-batch answers lines naming: ``--served-model-name``'s, else
    the model as given."""
    engine = read_serve(job.engine)
    given = engine.last().get("--served-model-name")
    if given:
        return list(given.values)
    return [engine.model] if engine.model else []
