"""vLLM's default sequence pooling of an embedding model, read as vLLM reads it: the
model's sentence-transformers pooling (``modules.json`` and its Pooling module's
``config.json``: vLLM's ``get_pooling_config``) where it names one, else the
architecture's (``default_seq_pooling_type`` of the model class vLLM serves it with).

vLLM's classes, by the architectures the worker loads (transformers' own):

- an encoder (BERT, RoBERTa, XLM-R, ModernBERT, NomicBERT, GTE, DistilBERT, ... and any
  other run through vLLM's Transformers backend, ``EmbeddingMixin``): ``CLS``;
- a generative model's (``*ForCausalLM``, and a ``*Model`` of a decoder-only family such
  as ``Qwen2Model`` or ``Gemma3TextModel``, which vLLM serves as the family's
  ``*ForCausalLM``, ``_normalize_arch``) states: ``LAST`` (``as_embedding_model``);
- ``GritLM``: its own pooler whatever the pooling type (``GritLMPooler``: the mean after
  the prompt's instruction, the embedding runner's ``gritlm``), its attention
  bidirectional; vLLM serves it as a pooling model with ``--runner auto`` (its class is a
  pooling model's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POOLINGS = {"MEAN": "mean", "CLS": "cls", "LAST": "last"}
"""vLLM's sequence pooling types and the embedding runner's ``pooling``."""
ST_POOLING = ("sentence_transformers.models.Pooling",
              "sentence_transformers.sentence_transformer.modules.pooling.Pooling")  # fmt: skip
"""sentence-transformers' Pooling module types vLLM reads (``_ST_POOLING_MODULE_TYPES``;
the second: sentence-transformers 5's)."""
ST_NORMALIZE = ("sentence_transformers.models.Normalize",
                "sentence_transformers.base.modules.normalize.Normalize",
                "sentence_transformers.sentence_transformer.modules.normalize.Normalize")  # fmt: skip
"""Its Normalize module types (``_ST_NORMALIZE_MODULE_TYPES``)."""
GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "ChatModel", "LMHeadModel")
"""vLLM's generative architecture suffixes."""
GRITLM = ("GritLM",)
"""Architectures vLLM embeds with its GritLM pooler (``GritLMMeanPool``)."""
GRITLM_POOLING = ("gritlm", "vLLM's GritLM pooler (GritLMMeanPool): the mean after the "
                  "prompt's instruction, the attention bidirectional")  # fmt: skip
"""The embedding runner's ``pooling`` for them, and why."""


def st_pooling(modes: Mapping[str, Any]) -> str | None:
    """The sequence pooling a Pooling module's ``config.json`` names, as vLLM reads it:
    each key set true (``pooling_mode_mean_tokens``), or ``pooling_mode``'s string
    (sentence-transformers 5), in the file's order, the last sequence pooling winning;
    ``mean_sqrt_len_tokens`` reads as ``MEAN``; None: none vLLM pools by (``max``,
    ``weightedmean``, a list of modes), so the architecture's default applies."""
    kind = None
    for key, value in modes.items():
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif value is True:
            name = key
        else:
            continue
        parsed = _parse(name)
        if parsed in POOLINGS:
            kind = parsed
    return kind


def _parse(name: str) -> str:
    """vLLM's ``parse_pooling_type``."""
    name = name.replace("pooling_mode_", "")
    name = name.split("_", 1)[0]
    return "LAST" if "lasttoken" in name else name.upper()


def architecture_pooling(cfg: Mapping[str, Any]) -> tuple[str, str]:
    """vLLM's default pooling type for the model ``cfg`` (its ``config.json``) describes,
    and why."""
    archs = architectures(cfg)
    for arch in archs:
        if arch.endswith(GENERATIVE):
            return "LAST", f"vLLM's default for a generative model's states ({arch})"
    model_type = cfg.get("model_type")
    if archs and archs[0].endswith("Model") and _decoder_only(model_type, archs[0]):
        return "LAST", (f"vLLM's default for a generative model's states ({archs[0]} is "
                        "served as its family's causal LM)")  # fmt: skip
    return "CLS", "vLLM's default for an encoder without sentence-transformers pooling"


def architectures(cfg: Mapping[str, Any]) -> list[str]:
    """``config.json``'s architectures (its strings)."""
    archs = cfg.get("architectures") or []
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def is_gritlm(cfg: Mapping[str, Any] | None) -> bool:
    """Whether vLLM serves the model as GritLM (its pooler, not a pooling type's)."""
    return cfg is not None and any(a in GRITLM for a in architectures(cfg))


def _decoder_only(model_type: Any, arch: str) -> bool:
    """Whether the family (``model_type``, else ``arch``'s prefix) generates text and has
    no masked-LM head: a decoder-only family, which vLLM serves as its causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )

    if isinstance(model_type, str) and model_type in CAUSAL:
        return model_type not in MASKED
    prefix = arch.removesuffix("Model")
    return f"{prefix}ForCausalLM" in CAUSAL.values() and f"{prefix}ForMaskedLM" not in \
        MASKED.values()  # fmt: skip
