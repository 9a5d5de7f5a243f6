"""``batchfleet from-vllm``: a ``vllm serve`` command line turned into a fleet file and the
``batchfleet gateway`` command serving the same API; a ``vllm run-batch`` one into the
fleet file and the ``batchfleet run-batch`` command (:mod:`.vllm_run_batch`).

Each flag goes to a model setting or option (the fleet file's line cites it), to a gateway
flag, to nothing (it changes nothing here: a comment says why), or is listed as having
no equivalent, with why. A flag this converter does not know is an error unless
``keep_going`` (then a comment names it). The fleet file is checked by the fleet loader
and the text-generation options by the runner's own tables before it is written. A
pooling model (:mod:`.vllm_pooling`) becomes an embedding, classification or rerank model.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .vllm_args import SECRETS, Flag, ServeArgs, VllmArgsError, long_name, read_serve
from .vllm_conversion import Conversion, Line
from .vllm_flags import (
    HANDLERS,
    SimpleOption,
    generation_defaults,
    judgement,
    lengths,
    rank,
    seed_default,
    simple_options,
)
from .vllm_pooling import is_pooling, pooling_settings, runner_line
from .vllm_run_batch import RunBatchArgs, command, is_run_batch, read_run_batch, settle
from .vllm_scheduling import speculative
from .vllm_serving import serving_defaults

ENV_SWITCHES = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "--allow-runtime-lora-updating",
                "VLLM_SERVER_DEV_MODE": "--server-dev-mode"}  # fmt: skip
"""vLLM's environment switches with a gateway flag."""


class ConversionError(ValueError):
    """The command line cannot become a fleet that starts (a bad value, unknown flags)."""


def convert(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Conversion:
    """``argv`` (a ``vllm serve`` command line, ``env`` its environment) converted; a
    :class:`ConversionError` where it names no model or a value would not start."""
    try:
        serve = read_serve(argv)
    except VllmArgsError as exc:
        raise ConversionError(str(exc)) from None
    if not serve.model:
        raise ConversionError("no model: give it as vLLM takes it (vllm serve MODEL ...)")
    flags = serve.last()
    out = Conversion(_model_name(serve, flags))
    try:
        out.model.append(runner_line(serve.model, flags))
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    _model_path(serve.model, flags, out)
    simple = simple_options()
    for flag in sorted(flags.values(), key=rank):
        try:
            _one(flag, out, simple)
        except (ValueError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{flag.shown()}: {exc}") from None
    try:
        speculative(out)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    if is_pooling(out):
        pooling_settings(serve.model, out)
    else:
        lengths(out)
        generation_defaults("--generation-config" in flags, out)
        seed_default("--seed" in flags, out)
    try:
        serving_defaults(out)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    _environment(env or {}, out)
    return out


def _one(flag: Flag, out: Conversion, simple: Mapping[str, SimpleOption]) -> None:
    name = flag.name
    if name in simple:
        key, kind = simple[name]
        out.option(flag, key, kind(flag.value))
    elif name in HANDLERS:
        HANDLERS[name](flag, out)
    elif (judged := judgement(name)) is not None:
        out.judged(flag, *judged)
    else:
        out.unknown.append(flag.shown())


def _model_name(serve: ServeArgs, flags: Mapping[str, Flag]) -> str:
    """The fleet's name of the model: ``--served-model-name``'s first, else the model's
    last path part, in the characters a fleet's model name takes."""
    given = flags.get("--served-model-name")
    raw = given.values[0] if given else Path(str(serve.model).rstrip("/")).name
    raw = raw.removesuffix(".gguf") if not given else raw
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", raw).lstrip("_.-")[:64] or "model"
    return name


def _model_path(model: str, flags: Mapping[str, Flag], out: Conversion) -> None:
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        out.model.append(Line("path", str(path.parent), f"the GGUF file {model}'s directory"))
        out.options.append(Line("gguf_file", path.name, model))
    elif path.exists() or model.startswith((".", "/", "~")):
        out.model.append(Line("path", model, "vllm serve's model"))
    else:
        out.model.append(Line("path", model, "a hub id, kept as given: machines with "
                              "HF_HUB_OFFLINE=1 need a local directory here"))  # fmt: skip
    given = flags.get("--served-model-name")
    served = given.values[0] if given else model
    if served != out.name:  # clients must change what they send: said on stderr too
        out.unsupported.append(f"the model name {served!r}: a fleet's is letters, digits, "
                               f"'_', '.', '-': clients send {out.name!r}")  # fmt: skip


def _environment(env: Mapping[str, str], out: Conversion) -> None:
    for var, flag in ENV_SWITCHES.items():
        if env.get(var, "").strip().lower() in ("1", "true"):
            out.gateway.append((flag,))
    if env.get("VLLM_API_KEY") and not any(a[0] == "--api-key" for a in out.gateway):
        out.unsupported.append("env VLLM_API_KEY: the gateway reads BATCHFLEET_API_KEY: set "
                               "it to the same key")  # fmt: skip
    if not any(a[0] == "--host" for a in out.gateway):
        out.gateway.insert(0, ("--host", "0.0.0.0"))  # vLLM's default: every interface


def render(conv: Conversion, argv: Sequence[str], fleet_path: str, run: str | None = None) -> str:
    """The fleet file's text: each line cites the vLLM flag it came from; ``run`` is the
    command shown after the worker's (default: the gateway's)."""
    given = shlex.join(_redacted(argv))
    then = run or conv.gateway_command(fleet_path, secret=False)
    out = [f"# From `batchfleet from-vllm`: {given}",
           f"# Run:  batchfleet worker --config {fleet_path}",
           f"#       {then}",
           'redis_url = "redis://127.0.0.1:6379/0"  # the fleet\'s Redis: set yours', "",
           f"[models.{_key(conv.name)}]"]  # fmt: skip
    out += [_line(ln) for ln in conv.model]
    if conv.options:
        out += ["", f"[models.{_key(conv.name)}.options]", *map(_line, conv.options)]
    if conv.adapters:
        out += ["", f"[models.{_key(conv.name)}.options.lora_adapters]"]
        out += map(_line, conv.adapters)
    for table, lines in (("batch", conv.batch), ("limits", conv.limits)):
        if lines:
            out += ["", f"[models.{_key(conv.name)}.{table}]", *map(_line, lines)]
    if conv.worker:
        out += ["", "[worker]", *map(_line, conv.worker)]
    for title, items in (("Nothing needed here", conv.needless),
                         ("No equivalent (not carried over)", conv.unsupported),
                         ("Unknown to from-vllm (dropped: --keep-going)", conv.unknown)):  # fmt: skip
        if items:
            out += ["", f"# {title}:", *(f"#   {item}" for item in items)]
    return "\n".join(out) + "\n"


def _redacted(argv: Sequence[str]) -> list[str]:
    """``argv`` without secrets' values (each value of ``--api-key k1 k2``)."""
    out = list(argv)
    hiding = False
    for i, arg in enumerate(out):
        if hiding and not arg.startswith("-"):
            out[i] = "***"
            continue
        name, eq, _ = arg.partition("=")
        hiding = long_name(name) in SECRETS and not eq
        if long_name(name) in SECRETS and eq:
            out[i] = f"{name}=***"
    return out


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


def _line(ln: Line) -> str:
    return f"{_key(ln.key)} = {_toml(ln.value)}  # {ln.source}"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def check(text: str) -> None:
    """``text`` loaded by the fleet loader, as a worker would load it (a
    :class:`ConversionError` says why it would not start)."""
    from pydantic import ValidationError

    from .config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "fleet.toml")
        path.write_text(text, encoding="utf-8")
        try:
            load_config(path)
        except (ValidationError, ValueError) as exc:  # TOMLDecodeError is one too
            raise ConversionError(f"the fleet file would not load: {exc}") from None


def from_vllm(argv: Sequence[str], *, out: str | None = None, keep_going: bool = False,
              env: Mapping[str, str] | None = None) -> tuple[int, str, str]:  # fmt: skip
    """The command: ``(exit code, stdout, stderr)``. The fleet file goes to ``out`` (then
    stdout shows the commands) or to stdout. 2: unknown flags (without ``keep_going``)
    or a command line that cannot be converted."""
    job: RunBatchArgs | None = None
    try:
        if is_run_batch(argv):
            job = read_run_batch(argv)
        conv = convert(job.engine if job else argv, os.environ if env is None else env)
    except (ConversionError, VllmArgsError) as exc:
        return 2, "", f"from-vllm: {exc}\n"
    if job:
        settle(job, conv)
    if conv.unknown and not keep_going:
        listed = "".join(f"  {u}\n" for u in conv.unknown)
        return 2, "", (f"from-vllm: flags it does not know (--keep-going writes the file "
                       f"without them, each named in a comment):\n{listed}")  # fmt: skip
    fleet_path = out or "fleet.toml"
    run = command(job, conv, fleet_path) if job else None
    text = render(conv, argv, fleet_path, run)
    try:
        check(text)
    except ConversionError as exc:
        return 2, "", f"from-vllm: {exc}\n"
    notes = "".join(f"from-vllm: no equivalent: {u}\n" for u in conv.unsupported)
    notes += "".join(f"from-vllm: dropped (unknown): {u}\n" for u in conv.unknown)
    if out is None:
        return 0, text, notes
    Path(out).write_text(text, encoding="utf-8")
    then = run or conv.gateway_command(out, secret=True)
    commands = f"batchfleet worker --config {out}\n{then}\n"
    return 0, commands, f"from-vllm: wrote {out}\n" + notes
