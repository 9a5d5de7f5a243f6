"""What a ``vllm serve`` command line becomes (:class:`Conversion`: the fleet file's lines,
each citing its flag, the gateway's flags, and the flags listed with why), and the
helpers the flags' handlers share."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from .vllm_args import Flag, human_int


def count(value: str) -> int:
    """A positive integer (a ``ValueError`` says why not)."""
    n = int(value)
    if n < 1:
        raise ValueError(f"{value} is not a positive integer")
    return n


def token_count(value: str) -> int:
    """A positive integer, with vLLM's suffixes (``8k``, ``32K``: :func:`.human_int`)."""
    return count(str(human_int(value)))


@dataclass(frozen=True, slots=True)
class Line:
    """One ``key = value`` of the fleet file and the vLLM flag it came from."""

    key: str
    value: Any
    source: str


@dataclass(slots=True)
class Conversion:
    """What a ``vllm serve`` command line becomes."""

    name: str
    model: list[Line] = field(default_factory=list)
    options: list[Line] = field(default_factory=list)
    adapters: list[Line] = field(default_factory=list)
    limits: list[Line] = field(default_factory=list)
    batch: list[Line] = field(default_factory=list)
    """The model's ``batch`` table (a pooling model's batch bounds)."""
    worker: list[Line] = field(default_factory=list)
    """The fleet file's ``[worker]`` table."""
    gateway: list[tuple[str, ...]] = field(default_factory=list)
    needless: list[str] = field(default_factory=list)
    """``flag: why nothing is needed``."""
    unsupported: list[str] = field(default_factory=list)
    """``flag: why it has no equivalent``."""
    unknown: list[str] = field(default_factory=list)

    def option(self, flag: Flag, key: str, value: Any) -> None:
        """Option ``key`` set from ``flag``; one another flag set is listed as overridden."""
        for ln in self.options:
            if ln.key == key and not ln.source.startswith(flag.name):
                self.needless.append(f"{ln.source}: {flag.name} sets {key} over it")
        self.options = [ln for ln in self.options if ln.key != key]
        self.options.append(Line(key, value, flag.shown()))

    def setting(self, key: str) -> Line | None:
        """The option ``key`` as set so far, or the model's setting ``key``."""
        return next((ln for ln in (*self.options, *self.model) if ln.key == key), None)

    def judged(self, flag: Flag, needless: bool, why: str) -> None:
        """``flag`` listed as needing nothing here (``needless``) or as having no
        equivalent, with ``why``."""
        (self.needless if needless else self.unsupported).append(f"{flag.shown()}: {why}")

    def gateway_command(self, fleet_path: str, *, secret: bool) -> str:
        """The ``batchfleet gateway`` command; without ``secret``, an API key is left to
        ``$BATCHFLEET_API_KEY`` (a fleet file is no place for it)."""
        argv = ["batchfleet", "gateway", "--config", fleet_path]
        hidden = False
        for args in self.gateway:
            if args[0] == "--api-key" and not secret:
                hidden = True
            else:
                argv += args
        return shlex.join(argv) + (_ENV_KEY if hidden else "")


_ENV_KEY = "  # and BATCHFLEET_API_KEY=<vLLM's --api-key> in its environment"
