"""A ``vllm serve`` command line read into its model and flags, as vLLM's parser reads it.

Only the shape is read here (which tokens are a flag's values; ``--flag=value``; the
short aliases; a ``--config`` YAML file's keys as flags, the command line winning);
what each flag means for a fleet is :mod:`.from_vllm`'s.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHORT = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size",
         "-dp": "--data-parallel-size", "-q": "--quantization", "-O": "--compilation-config"}  # fmt: skip
"""vLLM's short aliases."""

# fmt: off
SWITCHES = frozenset([
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager",
    "--enable-auto-tool-choice", "--enable-lora", "--no-enable-lora",
    "--return-tokens-as-token-ids", "--trust-remote-code", "--disable-log-requests",
    "--enable-log-requests", "--disable-log-stats", "--disable-uvicorn-access-log",
    "--disable-fastapi-docs", "--disable-frontend-multiprocessing", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--async-scheduling", "--no-async-scheduling",
    "--enable-expert-parallel", "--enable-sleep-mode", "--enable-lora-bias",
    "--fully-sharded-loras", "--headless", "--enable-prompt-tokens-details",
    "--enable-server-load-tracking", "--disable-custom-all-reduce", "--skip-tokenizer-init",
    "--enable-prompt-embeds", "--disable-sliding-window", "--disable-cascade-attn",
    "--enable-ssl-refresh", "--use-tqdm-on-load", "--no-use-tqdm-on-load", "--allow-credentials",
    "--calculate-kv-scales", "--enable-log-outputs",
])
LISTS = frozenset([
    "--lora-modules", "--served-model-name", "--allowed-origins", "--allowed-methods",
    "--allowed-headers", "--middleware",
])
# fmt: on
ARITY: dict[str, int | str] = {**dict.fromkeys(SWITCHES, 0), **dict.fromkeys(LISTS, "+")}
"""How many values the switches and lists this converter knows take; the other flags it
knows take one value, and a flag it does not know, those up to the next flag (none or more)."""


SECRETS = frozenset({"--api-key", "--hf-token"})
"""Flags whose values are never shown (a fleet file's comments, messages)."""


class VllmArgsError(ValueError):
    """A ``vllm serve`` command line that cannot be read (a flag without its value, a
    bad ``--config`` file)."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag as given: its long name (``--max-num-seqs``), its values, and where it
    came from (the command line or the ``--config`` file)."""

    name: str
    values: tuple[str, ...]
    origin: str = "command line"

    @property
    def value(self) -> str:
        return self.values[-1] if self.values else ""

    def shown(self) -> str:
        """As a user would write it (cited in the fleet file's comments)."""
        values = ["***"] * len(self.values) if self.name in SECRETS else self.values
        return " ".join((self.name, *values)).strip()


@dataclass(slots=True)
class ServeArgs:
    """A ``vllm serve`` command line: the model and the flags in order (the later of a
    repeated one wins, as with argparse)."""

    model: str | None = None
    flags: list[Flag] = field(default_factory=list)

    def last(self) -> dict[str, Flag]:
        """Each flag's last occurrence, in the order they were first given."""
        out: dict[str, Flag] = {}
        for f in self.flags:
            out[f.name] = f
        return out


def read_serve(argv: Sequence[str], known: Collection[str]) -> ServeArgs:
    """``argv`` (optionally starting with ``vllm serve`` or ``serve``) read into a
    :class:`ServeArgs`; ``known``: the flags known to take one value (unless in
    :data:`ARITY`). ``--config FILE`` flags come first so the command line wins."""
    args = list(argv)
    if args[:1] == ["vllm"]:
        args = args[1:]
    if args[:1] == ["serve"]:
        args = args[1:]
    out = ServeArgs()
    cli = _tokens(args, out, "command line", known)
    config = [f for f in cli if f.name == "--config"]
    if config:
        before = ServeArgs()
        before.flags = _tokens(
            _yaml_argv(config[-1].value), before, f"--config {config[-1].value}", known
        )
        out.model = out.model or before.model
        cli = before.flags + [f for f in cli if f.name != "--config"]
    out.flags = cli
    return out


def _tokens(args: list[str], out: ServeArgs, origin: str, known: Collection[str]) -> list[Flag]:
    flags: list[Flag] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token == "-":
            if out.model is not None:
                raise VllmArgsError(f"unexpected argument {token!r} (the model is {out.model!r})")
            out.model = token
            continue
        name, eq, inline = token.partition("=")
        name = SHORT.get(name, name)
        if name == "--model":
            if eq:
                out.model = inline
            elif i < len(args):
                out.model, i = args[i], i + 1
            else:
                raise VllmArgsError("--model needs a value")
            continue
        arity = ARITY.get(name, 1 if name in known or name == "--config" else "*")
        if eq:
            values: list[str] = [inline]
        elif arity == 0:
            values = []
        else:
            values = []
            while i < len(args) and (not args[i].startswith("-") or _number(args[i])):
                values.append(args[i])
                i += 1
                if arity == 1:
                    break
            if not values and arity != "*":
                raise VllmArgsError(f"{name} needs a value")
        flags.append(Flag(name, tuple(values), origin))
    return flags


def _number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _yaml_argv(path: str) -> list[str]:
    """vLLM's ``--config`` YAML (keys: long flag names, with ``-`` or ``_``) as flags:
    ``true`` a switch, ``false`` a ``--no-`` switch, a list several values, a mapping JSON."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers' dependencies include it
        raise VllmArgsError("--config needs PyYAML: pip install pyyaml") from None
    try:
        data: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise VllmArgsError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise VllmArgsError(f"--config {path}: a mapping of flag names to values")
    argv: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if name in ("--model", "--model-tag"):
            argv[:0] = ["--model", str(value)]
        elif value is True:
            argv.append(name)
        elif value is False:
            if ARITY.get(name) == 0 and ARITY.get(name.replace("--", "--no-", 1)) == 0:
                argv.append(name.replace("--", "--no-", 1))
        elif isinstance(value, list):
            argv += [name, *(_scalar(v) for v in value)]
        elif value is not None:
            argv += [name, _scalar(value)]
    return argv


def _scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)
