"""A step forward for Llama-family models without transformers' module stack.

A padded-engine step of a small model spends much of its time outside the matrix
products: each layer's forward goes through a dozen module calls, wrappers, keyword
plumbing and the cache interface, and the decode rows' products (a few dozen rows) run
at about half the speed of a prefill's. On a GPU the same host work is what a step waits
for: each operator costs host time to launch, and a small model's kernels take a tenth of
its step there (``bench/results/gpu-2026-12-04.md``). For the architectures whose decoder
layer this module knows (pre-norm, rotary positions, grouped-query attention, gated MLP:
``llama``, ``mistral``, ``qwen2``), :class:`LeanDecoder` runs a step's operations
directly, on the model's own modules and weights, over the step's decode rows and
prefill chunks at once:

- the model's own embedding, norms (``RMSNorm``), rotary embedding and
  ``apply_rotary_pos_emb``, activation and LM head, so every number is computed as
  transformers computes it (q and k rotated in one pass, with the module's
  ``rotate_half``, where that gives ``apply_rotary_pos_emb``'s numbers exactly, checked
  when the decoder is built);
- q, k and v in one matrix product, and gate and up in another (the weights
  concatenated once, at build), each over all the step's tokens; with
  ``matmul_precision`` ``medium`` the weights are the modules' bfloat16 ones and each
  product is the one their forward computes (:func:`..precision.linear`);
- the decode rows' keys and values written by the engine's :class:`~.padded_cache.SlotLayer`
  and attended either by the per-row kernel (each row over its own length: a float32
  model on the CPU; planned once a step for all layers; each layer's buffers read through
  the arrays made with them, :func:`.decode_attention.attend_arrays`, no views made a
  layer; written straight into the step's attention output, one buffer every layer
  reuses) or, on any other device or dtype, by transformers' ``sdpa`` function over the
  padded batch under a padding mask (as the engine's transformers forward and HF
  ``generate`` attend);
- each prefill chunk's appended to its sequence's own cache and attended causally by
  transformers' ``sdpa`` function, as its prefill forward does;
- keys and values held in another dtype than the model's (the engine's
  ``kv_cache_dtype``) read widened, by the kernel or for sdpa
  (:func:`.decode_attention.sdpa`);
- logits only for the decode rows and each chunk's last token;
- where a step's tokens use LoRA adapters (:mod:`.lora`), each product adds each
  adapter's low-rank update on its own tokens (none used: no work).

Models whose layers do not match keep transformers' forwards.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..precision import MixedLinear, linear
from . import decode_attention
from . import lora as lora_

FAMILIES = frozenset({"llama", "mistral", "qwen2"})
"""``config.model_type`` values whose decoder layer :class:`LeanDecoder` reproduces."""
_PLAIN = (torch.nn.Linear, MixedLinear)
"""The projection types it multiplies by directly: plain, or bfloat16 (``matmul_precision``
``medium``: :func:`..precision.linear`, the product their forward computes)."""


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
    """One step's forward for a Llama-family model (module docstring)."""

    def __init__(
        self, model: Any, layers: list[_Layer], rotate: Any, rotate_half: Any = None
    ) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.head = model.lm_head
        self.layers = layers
        self.rotate = rotate
        self.rotate_half = rotate_half
        """Set where ``x * cos + rotate_half(x) * sin`` is ``rotate``'s formula: q and k
        are then rotated together, as one tensor (half the operators)."""
        self.rms = self.embed.weight.dtype == torch.float32 and all(
            _rms_exact(n) for n in (self.norm, *(
            m for la in layers for m in (la.input_norm, la.post_norm))))  # fmt: skip
        """Whether every norm is a float32 Llama ``RMSNorm`` that :func:`_rms` computes
        exactly (its operators, fewer allocations); else the modules run."""
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
        module = sys.modules.get(type(model).__module__)
        rotate = getattr(module, "apply_rotary_pos_emb", None)
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
        return cls(model, layers, rotate, _one_pass(rotate, getattr(module, "rotate_half", None)))

    def logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: np.ndarray,
        caches: Sequence[Any],
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rows x vocab`` logits of one decode step: row ``i`` feeds token ``ids[i, 0]``
        at position ``positions[i]`` and attends over ``lengths[i]`` keys (its cache and
        the new one); ``caches``: the engine's layers, which store the new keys and
        values (their step already set); ``padding``: see :meth:`forward`."""
        return self.forward(ids.view(-1), positions, lengths, caches, (), padding)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: np.ndarray,
        caches: Sequence[Any],
        chunks: Sequence[Chunk],
        padding: torch.Tensor | None = None,
        every: Sequence[bool] = (),
        lora: Sequence[tuple[lora_.Fused, torch.Tensor]] = (),
    ) -> torch.Tensor:
        """One step's forward over the decode rows and prefill chunks together (the
        linear layers run once over all their tokens): decode row ``i`` feeds ``ids[i]``
        at ``positions[i]`` and attends over ``lengths[i]`` keys of ``caches`` (the
        engine's layers, their step already set); each chunk feeds its tokens after its
        cache's and appends to it. ``padding`` None: the decode rows attend through the
        per-row kernel; else through sdpa over the padded batch, ``padding`` being its
        ``rows x 1 x 1 x columns`` mask (:func:`padding_mask`). The logits of every
        decode row, then of each chunk's last token, or of all its tokens where
        ``every`` says so (a chunk whose prompt log-probabilities are kept). ``lora``: each
        LoRA adapter the step's tokens use and those tokens' indices (:func:`.lora.groups`;
        empty: the base model's products alone)."""
        rows = ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        if chunks:
            device = self.head.weight.device
            ids = torch.cat([ids, *(torch.tensor(c.tokens, device=device) for c in chunks)])
            positions = torch.cat([positions, *(
                torch.arange(c.past, c.past + len(c.tokens), device=device) for c in chunks
            )])  # fmt: skip
        total = ids.shape[0]
        x = self.embed(ids)[None]  # 1 x tokens x hidden
        cos, sin = self.rotary(x, positions[None])
        one_pass = self.rotate_half is not None
        if one_pass:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # as apply_rotary_pos_emb does
            half = dim // 2
            signed = (-sin[..., :half], sin[..., half:])  # rotate_half's sign moved to sin
        norm = _rms if self.rms else _module
        masks = [_causal(c, self.head.weight.device) for c in chunks]
        # once a step for every layer: the rows' kernel plan (lengths checked) and the
        # attention output, which each layer's o product reads before the next writes it
        plan = decode_attention.rows(lengths, kv_heads) if rows and padding is None else None
        if rows and padding is None and plan is None:  # sdpa unmasked would attend padding
            raise RuntimeError("a decode step marked for per-row attention cannot use it here")
        attended = torch.empty((total, q_end), dtype=x.dtype, device=x.device)
        row_out = attended[:rows].numpy() if plan is not None else None
        for i, layer in enumerate(self.layers):
            h = norm(layer.input_norm, x)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            if lora:
                lora_.apply(qkv, h, i, "qkv", lora)
            v = qkv[..., k_end:].view(1, total, kv_heads, dim).transpose(1, 2)
            if one_pass:
                qk = qkv[..., :k_end].view(1, total, heads + kv_heads, dim).transpose(1, 2)
                qk = _rotated(qk, cos, signed, half)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = qkv[..., :q_end].view(1, total, heads, dim).transpose(1, 2)
                k = qkv[..., q_end:k_end].view(1, total, kv_heads, dim).transpose(1, 2)
                q, k = self.rotate(q, k, cos, sin)
            if rows:
                keys, values = caches[i].update(_rows(k, 0, rows), _rows(v, 0, rows))
                whole = getattr(caches[i], "arrays", None) if plan is not None else None
                if whole is not None:  # the buffers' arrays, made once (no views a layer)
                    assert plan is not None and row_out is not None
                    decode_attention.attend_arrays(plan, _rows(q, 0, rows), whole[0][:rows],
                                                   whole[1][:rows], layer.scaling, row_out)  # fmt: skip
                elif plan is not None:
                    decode_attention.attend_rows(plan, _rows(q, 0, rows), keys, values,
                                                 layer.scaling, attended[:rows])  # fmt: skip
                else:
                    out, _ = decode_attention.sdpa(
                        layer.attn, _rows(q, 0, rows), keys, values, padding,
                        scaling=layer.scaling,
                    )  # fmt: skip
                    attended[:rows].copy_(out.reshape(rows, q_end))
            at = rows
            for c, mask in zip(chunks, masks, strict=True):
                n = len(c.tokens)
                keys, values = c.cache.update(k[:, :, at : at + n], v[:, :, at : at + n], i)
                out, _ = decode_attention.sdpa(
                    layer.attn, q[:, :, at : at + n], keys, values, mask, scaling=layer.scaling
                )
                attended[at : at + n].copy_(out.reshape(n, q_end))
                at += n
            o = linear(attended[None], layer.o, layer.o_bias)
            if lora:
                lora_.apply(o, attended[None], i, "o", lora)
            x.add_(o)  # (x: this forward's own, the embedding's copy or a sum)
            h = norm(layer.post_norm, x)
            gu = linear(h, layer.gate_up, layer.gate_up_bias)
            if lora:
                lora_.apply(gu, h, i, "gate_up", lora)
            mid = layer.act(gu[..., : self.intermediate]).mul_(gu[..., self.intermediate :])
            down = linear(mid, layer.down, layer.down_bias)
            if lora:
                lora_.apply(down, mid, i, "down", lora)
            x.add_(down)
        if chunks:
            ends = np.cumsum([rows] + [len(c.tokens) for c in chunks])[1:] - 1
            if any(every):
                keep_rows = [np.arange(rows)]
                for c, end, whole in zip(chunks, ends, every, strict=True):
                    keep_rows.append(np.arange(end - len(c.tokens) + 1, end + 1) if whole
                                     else np.array([end]))  # fmt: skip
                keep = torch.from_numpy(np.concatenate(keep_rows))
            else:
                keep = torch.from_numpy(np.concatenate([np.arange(rows), ends]))
            x = x[:, keep.to(x.device)]
        logits: torch.Tensor = self.head(norm(self.norm, x))
        return logits[0]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a prompt to prefill within a step: ``tokens`` after the ``past`` tokens
    already in ``cache`` (the sequence's own, which takes their keys and values)."""

    tokens: Sequence[int]
    past: int
    cache: Any


def padding_mask(positions: torch.Tensor, width: int) -> torch.Tensor:
    """The decode rows' mask over ``width + 1`` columns of the padded batch: row ``i``
    sees its columns up to ``positions[i]`` (its new token's), ``rows x 1 x 1 x cols``."""
    cols = torch.arange(width + 1, device=positions.device)
    return (cols[None, :] <= positions[:, None])[:, None, None, :]


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``start:end`` of a ``1 x heads x tokens x dim`` tensor as decode rows:
    ``rows x heads x 1 x dim``."""
    return t[0, :, start:end].transpose(0, 1)[:, :, None]


def _causal(chunk: Chunk, device: torch.device) -> torch.Tensor | None:
    """The chunk's attention mask over its cache and itself (None: plain causal, from
    the start, which sdpa runs without a mask as transformers' prefill does)."""
    n = len(chunk.tokens)
    if chunk.past == 0 or n == 1:
        return None
    cols = torch.arange(chunk.past + n, device=device)
    rows = torch.arange(chunk.past, chunk.past + n, device=device)
    return (cols[None, :] <= rows[:, None])[None, None]


def _rotated(
    qk: torch.Tensor, cos: torch.Tensor, signed: tuple[torch.Tensor, torch.Tensor], half: int
) -> torch.Tensor:
    """``qk * cos + rotate_half(qk) * sin``, the same numbers (a product's sign moves
    exactly), in four operators instead of six: ``signed`` is ``(-sin[..., :half],
    sin[..., half:])``."""
    out = qk * cos
    turned = torch.empty_like(out)
    torch.mul(qk[..., half:], signed[0], out=turned[..., :half])
    torch.mul(qk[..., :half], signed[1], out=turned[..., half:])
    return out.add_(turned)


def _module(norm: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = norm(x)
    return out


def _rms(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` for a float32 Llama ``RMSNorm`` (:func:`_rms_exact`): its operators on
    ``x``, in place where they may be (half the tensors it allocates)."""
    scale = x.pow(2).mean(-1, keepdim=True)
    scale.add_(norm.variance_epsilon).rsqrt_()
    return torch.mul(x, scale).mul_(norm.weight)  # weight * y: the same product


def _rms_exact(norm: Any) -> bool:
    """Whether :func:`_rms` computes what ``norm`` does: a float32 weight and epsilon,
    and the same numbers on a random input (a family's norm with another formula, say
    ``1 + weight``, differs there)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or eps is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, weight.shape[-1], generator=gen).to(weight.device)
    try:
        with torch.inference_mode():
            return bool(torch.equal(_rms(norm, x), norm(x)))
    except Exception:
        return False


def _one_pass(rotate: Any, rotate_half: Any) -> Any:
    """``rotate_half`` where ``x * cos + rotate_half(x) * sin`` gives exactly what
    ``rotate`` (the family's ``apply_rotary_pos_emb``) gives for q and k; else None."""
    if rotate_half is None:
        return None
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    cos, sin = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 5, 8, generator=gen)
    try:
        want_q, want_k = rotate(q, k, cos, sin)
        both = torch.cat([q, k], dim=1)
        got = both * cos.unsqueeze(1) + rotate_half(both) * sin.unsqueeze(1)
        s = sin.unsqueeze(1)
        split = _rotated(both, cos.unsqueeze(1), (-s[..., :4], s[..., 4:]), 4)
    except Exception:
        return None
    want = torch.cat([want_q, want_k], dim=1)
    return rotate_half if torch.equal(got, want) and torch.equal(split, want) else None


def _layer(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj)  # fmt: skip
    if not all(type(p) in _PLAIN for p in projections):
        raise TypeError("a projection is not a plain Linear (quantized or adapted)")
    if len({p.weight.dtype for p in projections}) != 1:
        raise TypeError("the projections' weights differ in dtype")
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
    biases = [p.bias for p in linears]
    some = next((b for b in biases if b is not None), None)
    if some is None:
        return None
    return torch.cat([
        b.detach() if b is not None else some.new_zeros(p.out_features)
        for b, p in zip(biases, linears, strict=True)
    ])  # fmt: skip
