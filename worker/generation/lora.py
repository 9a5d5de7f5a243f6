"""PEFT LoRA adapters served beside their base model (vLLM's multi-LoRA).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` as
PEFT's ``save_pretrained`` writes them; it is read here with safetensors alone (no peft
at runtime) and checked against the base model when the worker starts: what is not
served is refused then, with a ``ValueError`` naming the adapter and why (DoRA, biases,
``modules_to_save``, per-module ranks, targets other than the decoder layers' seven
projections (``target_modules`` names them, or is ``all-linear``, or a regex: the weights
present then tell), a rank over ``max_lora_rank``, a layer or shape the base lacks).

A targeted projection computes ``W x + scale * B (A x)`` (``scale``: ``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with ``use_rslora``). The weights are kept as
:class:`~.lean_decode.LeanDecoder` runs its layers: per layer and fused product (q, k and
v in one; gate and up in one), the targeted projections' ``A`` concatenated along the
rank and their ``B`` placed block-wise in one ``outputs x ranks`` matrix (zero where a
projection is not targeted, scale folded in), so each product takes one low-rank update
per adapter in a step: :func:`apply`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROJECTIONS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}  # fmt: skip
"""The projections an adapter may target: each one's fused product and place in it."""
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}  # fmt: skip
"""The lean decoder's products, each of its projections in output order."""
MAX_RANK = 512
"""The highest ``max_lora_rank`` (vLLM's largest)."""
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_REFUSED = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
            "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks "
            "(rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
            "layers_to_transform": "layers_to_transform", "layer_replication":
            "layer_replication", "target_parameters": "target_parameters",
            "trainable_token_indices": "trainable_token_indices"}  # fmt: skip
"""Config entries that, set, ask for more than a plain LoRA of linear layers."""

Update = tuple[torch.Tensor, torch.Tensor]
"""One fused product's ``A`` (``ranks x inputs``) and scaled ``B`` (``outputs x ranks``)."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """One loaded adapter: per decoder layer, its update of each fused product it targets."""

    name: str
    rank: int
    scale: float
    layers: tuple[dict[str, Update], ...]


def load(name: str, path: str | Path, model: Any, max_rank: int) -> Adapter:
    """Read the adapter at ``path`` for ``model`` (a Llama-family causal LM), on its device
    and in its dtype; a ``ValueError`` naming it says what is not served (module docstring)."""
    where = Path(path)

    def refuse(why: str) -> ValueError:
        return ValueError(f"options.lora_adapters: adapter {name!r} ({where}): {why}")

    try:
        config = json.loads((where / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise refuse(f"cannot read adapter_config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise refuse("adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise refuse(f"{what} is not served")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config.get('bias')!r} is not served (only 'none')")
    targets = config.get("target_modules")  # a string: "all-linear", or a regex
    if isinstance(targets, list):  # names, matched as PEFT does: a module path's end
        other = sorted({str(t) for t in targets if str(t).rsplit(".", 1)[-1] not in PROJECTIONS})
        if other:
            raise refuse(f"target_modules {other[:4]} are not served (only "
                         f"{', '.join(PROJECTIONS)}, or 'all-linear')")  # fmt: skip
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r {rank!r} is not a positive integer")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over max_lora_rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha {alpha!r} is not a number")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = where / "adapter_model.safetensors"
    if not weights.is_file():
        raise refuse("adapter_model.safetensors is missing (only safetensors weights are read)")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except Exception as exc:
        raise refuse(f"cannot read adapter_model.safetensors: {exc}") from exc
    return Adapter(name, rank, scale, _fuse(tensors, model, rank, scale, refuse))


def _fuse(tensors: dict[str, torch.Tensor], model: Any, rank: int, scale: float,
          refuse: Any) -> tuple[dict[str, Update], ...]:  # fmt: skip
    """The tensors checked against ``model``'s layers and fused (module docstring)."""
    base = model.model.layers
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in PROJECTIONS:
            raise refuse(f"weight {key!r} is not a LoRA weight of a served projection")
        layer, proj = int(m.group(1)), m.group(2)
        if layer >= len(base):
            raise refuse(f"weight {key!r}: the base model has {len(base)} layers")
        found.setdefault((layer, proj), {})[m.group(3)] = tensor
    if not found:
        raise refuse("adapter_model.safetensors holds no LoRA weights")
    param = next(model.parameters())
    layers: list[dict[str, Update]] = [{} for _ in base]
    for i, modules in enumerate(base):
        for fused, projs in FUSED.items():
            linears = [_linear(modules, p) for p in projs]
            if not any((i, p) in found for p in projs):
                continue
            a_parts, b_parts = [], []
            for p, linear in zip(projs, linears, strict=True):
                pair = found.get((i, p))
                if pair is None:
                    continue
                a, b = pair.get("A"), pair.get("B")
                if a is None or b is None:
                    raise refuse(f"layer {i} {p}: lora_A and lora_B are not both there")
                want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
                if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                    raise refuse(f"layer {i} {p}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not fit the base's {want_a} and "
                                 f"{want_b} (another base model, or another r)")  # fmt: skip
                a_parts.append(a)
                b_parts.append(_placed(b, projs.index(p), linears))
            a_cat = torch.cat(a_parts).to(param.device, param.dtype).contiguous()
            b_cat = (torch.cat(b_parts, dim=1) * scale).to(param.device, param.dtype).contiguous()
            layers[i][fused] = (a_cat, b_cat)
    return tuple(layers)


def _linear(layer: Any, proj: str) -> torch.nn.Linear:
    parent = layer.self_attn if proj in FUSED["qkv"] or proj == "o_proj" else layer.mlp
    linear: torch.nn.Linear = getattr(parent, proj)
    return linear


def _placed(b: torch.Tensor, index: int, linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """``b`` (projection ``index`` of the fused product's ``linears``) in its rows of an
    ``outputs x rank`` block, zeros elsewhere: the fused ``B`` is these side by side, one
    block per targeted projection."""
    outputs = sum(int(lin.out_features) for lin in linears)
    start = sum(int(lin.out_features) for lin in linears[:index])
    out = b.new_zeros((outputs, b.shape[1]))
    out[start : start + b.shape[0]] = b
    return out


def groups(labels: Sequence[int], adapters: Sequence[Adapter],
           device: torch.device) -> list[tuple[Adapter, torch.Tensor]]:  # fmt: skip
    """A step's tokens by adapter (``labels``: per token, its adapter's index in
    ``adapters`` plus one; 0: the base model): each adapter used and its tokens' indices.
    Empty where no token has one."""
    have = np.asarray(labels, dtype=np.int64)
    used = np.unique(have[have > 0])
    return [(adapters[int(a) - 1], torch.from_numpy(np.flatnonzero(have == a)).to(device))
            for a in used]  # fmt: skip


def apply(out: torch.Tensor, x: torch.Tensor, layer: int, fused: str,
          lora: Sequence[tuple[Adapter, torch.Tensor]]) -> None:  # fmt: skip
    """Add to ``out`` (``1 x tokens x outputs``: the product ``fused`` of layer ``layer``
    over inputs ``x``, ``1 x tokens x inputs``) each adapter's update on its tokens."""
    for adapter, at in lora:
        update = adapter.layers[layer].get(fused)
        if update is None:
            continue
        a, b = update
        rows = x[0].index_select(0, at)
        out[0].index_add_(0, at, (rows @ a.T) @ b.T)
