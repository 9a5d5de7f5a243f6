"""Model handlers by name, or any class given as ``package.module:Class``."""

from __future__ import annotations

import importlib
from typing import Any

from .base import Encoded, Handler

BUILTIN = {
    "embedding": "batchfleet.worker.handlers.embedding:EmbeddingHandler",
    "text-classification": "batchfleet.worker.handlers.classification:ClassificationHandler",
}

__all__ = ["BUILTIN", "Encoded", "Handler", "resolve"]


def resolve(spec: str) -> type[Any]:
    """Return the handler class for a built-in name or an import path ``mod:Class``."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ValueError(
            f"unknown handler {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:Class'"
        )
    return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
