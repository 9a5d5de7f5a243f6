"""A ``vllm serve`` command line read into its model and flags, as vLLM's parser reads it.

Only the shape is read here, as vLLM's ``FlexibleArgumentParser`` reads it: which tokens
are a flag's values (:mod:`.vllm_catalog`), ``--flag=value``, ``_`` for ``-`` in names,
the short aliases and ``-O3``, a long flag's unambiguous prefix (argparse's), a JSON
flag's keys given one by one (``--speculative-config.method ngram``), a ``--config`` YAML
file's keys as flags, the command line winning; what each flag means for a fleet is
:mod:`.from_vllm`'s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .vllm_catalog import APPENDED, ARITY, SHORT

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
        """Each flag's last occurrence (of one vLLM appends to, all its values), in the
        order they were first given."""
        out: dict[str, Flag] = {}
        for f in self.flags:
            before = out.get(f.name)
            if before is not None and f.name in APPENDED:
                f = Flag(f.name, before.values + f.values, f.origin)
            out[f.name] = f
        return out


def read_serve(argv: Sequence[str]) -> ServeArgs:
    """``argv`` (optionally starting with ``vllm serve`` or ``serve``) read into a
    :class:`ServeArgs`. ``--config FILE`` flags come first so the command line wins."""
    args = list(argv)
    if args[:1] == ["vllm"]:
        args = args[1:]
    if args[:1] == ["serve"]:
        args = args[1:]
    out = ServeArgs()
    cli = _tokens(_normalized(args), out, "command line")
    config = [f for f in cli if f.name == "--config"]
    if config:
        before = ServeArgs()
        path = config[-1].value
        before.flags = _tokens(_normalized(_yaml_argv(path)), before, f"--config {path}")
        out.model = out.model or before.model
        cli = before.flags + [f for f in cli if f.name != "--config"]
    out.flags = cli
    return out


def human_int(text: str) -> int:
    """vLLM's numbers with a suffix (``human_readable_int``): ``8k`` is 8,000, ``8K``
    8,192 (``k m g t`` decimal, ``K M G T`` binary, which takes no decimals)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
    if not match:
        return int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(f"{text}: no decimals with a binary suffix ({number}{suffix.lower()}?)")
    return int(number) * int(1024 ** ("KMGT".index(suffix) + 1))


def _normalized(args: list[str]) -> list[str]:
    """``args`` as vLLM's parser rewrites them before reading: ``_`` as ``-`` in long
    names, ``-O3`` as ``--optimization-level 3``, and a JSON flag's keys given one by one
    (``--speculative-config.method ngram``, ``--x.list+ a,b``) as one JSON value, last."""
    plain: list[str] = []
    dicts: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, eq, value = token.partition("=")
        if token.startswith("--"):
            head, dot, keys = name[2:].partition(".")
            name = "--" + head.replace("_", "-") + dot + keys
        elif token.startswith("-O") and token != "-O":  # -O3, -O=3
            plain += ["--optimization-level", token[3:] if token[2:3] == "=" else token[2:]]
            continue
        elif token == "-O" and i < len(args) and args[i] in ("0", "1", "2", "3"):
            name = "--optimization-level"
        if not name.startswith("-") or "." not in name or _number(name):
            plain.append(name + eq + value)
            continue
        if not eq:
            if i == len(args):
                raise VllmArgsError(f"{name} needs a value")
            value, i = args[i], i + 1
        key, *path = name.split(".")
        _merge(dicts.setdefault(key, {}), path, value)
    for key, merged in dicts.items():
        plain += [key, json.dumps(merged)]
    return plain


def _merge(into: dict[str, Any], path: list[str], text: str) -> None:
    """``text`` set at ``path`` in ``into`` as vLLM reads it: JSON, else a number with a
    suffix, else text; a key ending in ``+`` adds the comma-separated items to a list."""
    value: Any
    if path[-1].endswith("+"):
        path = [*path[:-1], path[-1][:-1]]
        value = text.split(",")
    else:
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = human_int(text)
            except ValueError:
                value = text
    for key in path[:-1]:
        if not isinstance(into.get(key), dict):
            into[key] = {}
        into = into[key]
    if isinstance(value, list) and isinstance(into.get(path[-1]), list):
        into[path[-1]] += value
    else:
        into[path[-1]] = value


def long_name(name: str) -> str:
    """A flag's long name: with ``-`` for ``_``, its alias's, or the one flag that begins
    with it (argparse's abbreviations); else as given."""
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    name = SHORT.get(name, name)
    names = (*ARITY, *SHORT, "--model", "--config")
    if name in names or not name.startswith("--"):
        return name
    matches = [n for n in names if n.startswith(name)]
    return SHORT.get(matches[0], matches[0]) if len(matches) == 1 else name


def _tokens(args: list[str], out: ServeArgs, origin: str) -> list[Flag]:
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
        name = long_name(name)
        if name == "--model":
            if eq:
                out.model = inline
            elif i < len(args):
                out.model, i = args[i], i + 1
            else:
                raise VllmArgsError("--model needs a value")
            continue
        arity = ARITY.get(name, 1 if name == "--config" else "*")
        if eq and arity == 0:
            raise VllmArgsError(f"{name} takes no value (given {inline!r})")
        values: list[str] = [inline] if eq else []
        while not eq and arity != 0 and i < len(args):
            if args[i].startswith("-") and not _number(args[i]):
                break
            values.append(args[i])
            i += 1
            if arity in (1, "?"):
                break
        if not values and arity in (1, "+"):
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
    """vLLM's ``--config`` YAML (keys: long flag names) as flags, as vLLM turns it into
    flags: ``true`` a switch, ``false`` its ``--no-`` form where the flag has one, a list
    several values, a mapping JSON."""
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
        name = f"--{key}"
        if name.replace("_", "-") in ("--model", "--model-tag"):
            argv[:0] = ["--model", str(value)]
        elif value is True:
            argv.append(name)
        elif value is False:
            if f"--no-{key}" in ARITY:  # as vLLM checks it: with the key as written
                argv.append(f"--no-{key}")
        elif isinstance(value, list):
            argv += [name, *(_scalar(v) for v in value)] if value else []
        elif value is not None:
            argv += [name, _scalar(value)]
    return argv


def _scalar(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)
