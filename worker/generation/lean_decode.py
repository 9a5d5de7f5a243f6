"""A decode forward for Llama-family models without transformers' module stack.

A padded-engine decode step of a small model spends much of its time in Python: each
layer's forward goes through a dozen module calls, wrappers, keyword plumbing and the
cache interface, whatever the batch. On the benchmark's 4-layer model that is about a
fifth of a 36-row decode step and a third of a 4-row one (``python -m
bench.generation``). For the architectures whose decoder layer this module knows
(pre-norm, rotary positions, grouped-query attention, gated MLP: ``llama``, ``mistral``,
``qwen2``), :class:`LeanDecoder` runs a decode step's operations directly, on the
model's own modules and weights:

- the model's own embedding, norms (``RMSNorm``), rotary embedding and
  ``apply_rotary_pos_emb``, activation and LM head, so every number is computed as
  transformers computes it;
- q, k and v in one matrix product, and gate and up in another (the weights
  concatenated once, at build), which gives the same values as three or two products;
- keys and values written by the engine's :class:`~.padded.SlotLayer`, attention by
  :func:`.decode_attention.attention` (each row over its own length).

It is used only where the engine's decode runs the per-row kernel (a float32 model on
the CPU) and the model's layers match; anything else keeps transformers' forward.
The prefill always does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import decode_attention

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
"""``config.model_type`` values whose decoder layer :class:`LeanDecoder` reproduces."""


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: Any
    post_norm: Any
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: Any
    attn: torch.nn.Module
    scaling: float


class LeanDecoder:
    """One decode step's logits for a Llama-family model (module docstring)."""

    def __init__(self, model: Any, layers: list[_Layer], rotate: Any) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.head = model.lm_head
        self.layers = layers
        self.rotate = rotate
        attn = layers[0].attn
        self.heads = int(model.config.num_attention_heads)
        self.kv_heads = int(model.config.num_key_value_heads)
        self.head_dim = int(attn.head_dim)
        self.intermediate = int(layers[0].down.shape[1])

    @classmethod
    def build(cls, model: Any) -> LeanDecoder | None:
        """The lean decoder for ``model``, or None where its layers are not the known
        shape (then the engine keeps transformers' forward)."""
        config = getattr(model, "config", None)
        inner = getattr(model, "model", None)
        if (
            config is None
            or inner is None
            or getattr(config, "model_type", None) not in FAMILIES
            or (getattr(config, "pretraining_tp", 1) or 1) != 1
            or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            or not isinstance(getattr(model, "lm_head", None), torch.nn.Linear)
        ):
            return None
        rotate = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
        if rotate is None:
            return None
        layers = []
        try:
            for layer in inner.layers:
                layers.append(_layer(layer))
        except (AttributeError, TypeError, ValueError):
            return None
        if not layers:
            return None
        return cls(model, layers, rotate)

    def logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: np.ndarray,
        caches: Sequence[Any],
    ) -> torch.Tensor:
        """``rows x vocab`` logits of one decode step: row ``i`` feeds token ``ids[i, 0]``
        at position ``positions[i]`` and attends over ``lengths[i]`` keys (its cache and
        the new one); ``caches``: the engine's layers, which store the new keys and
        values (their step already set)."""
        rows = ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        x = self.embed(ids)  # rows x 1 x hidden, as transformers' forward has it
        cos, sin = self.rotary(x, positions[:, None])
        kw: dict[str, Any] = {decode_attention.LENGTHS: lengths}
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer.input_norm(x)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[..., :q_end].view(rows, 1, heads, dim).transpose(1, 2)
            k = qkv[..., q_end:k_end].view(rows, 1, kv_heads, dim).transpose(1, 2)
            v = qkv[..., k_end:].view(rows, 1, kv_heads, dim).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            keys, values = cache.update(k, v)
            out, _ = decode_attention.attention(
                layer.attn, q, keys, values, None, scaling=layer.scaling, **kw
            )
            x = x + F.linear(out.reshape(rows, 1, q_end), layer.o, layer.o_bias)
            h = layer.post_norm(x)
            gu = F.linear(h, layer.gate_up, layer.gate_up_bias)
            mid = layer.act(gu[..., : self.intermediate]) * gu[..., self.intermediate :]
            x = x + F.linear(mid, layer.down, layer.down_bias)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits[:, -1]


def _layer(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj)  # fmt: skip
    if not all(type(p) is torch.nn.Linear for p in projections):
        raise TypeError("a projection is not a plain Linear (quantized or adapted)")
    if getattr(attn, "q_norm", None) is not None or getattr(attn, "sliding_window", None):
        raise TypeError("attention with per-head norms or a sliding window")
    return _Layer(
        input_norm=layer.input_layernorm,
        post_norm=layer.post_attention_layernorm,
        qkv=_cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
        qkv_bias=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
        o=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        gate_up=_cat(mlp.gate_proj.weight, mlp.up_proj.weight),
        gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
        down=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
        act=mlp.act_fn,
        attn=attn,
        scaling=float(attn.scaling),
    )


def _cat(*weights: torch.Tensor) -> torch.Tensor:
    return torch.cat([w.detach() for w in weights]).contiguous()


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(p.bias is None for p in linears):
        return None
    return torch.cat([
        p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features)
        for p in linears
    ])  # fmt: skip
