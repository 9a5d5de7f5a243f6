"""Runners by name, or any class given as ``package.module:Class``."""

from __future__ import annotations

import importlib
from typing import Any

BUILTIN = {
    "embedding": "batchfleet.worker.runners.embedding:EmbeddingRunner",
    "text-classification": "batchfleet.worker.runners.classification:ClassificationRunner",
    "text-generation": "batchfleet.worker.runners.generation:TextGenerationRunner",
    "image-classification": (
        "batchfleet.worker.runners.image_classification:ImageClassificationRunner"
    ),
    "image-text-embedding": "batchfleet.worker.runners.image_text:ImageTextEmbeddingRunner",
    "rerank": "batchfleet.worker.runners.rerank:RerankRunner",
}

__all__ = ["BUILTIN", "resolve"]


def resolve(spec: str) -> type[Any]:
    """Return the runner class for a built-in name or an import path ``mod:Class``."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ValueError(
            f"unknown runner {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:Class'"
        )
    return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]
