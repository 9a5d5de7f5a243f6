"""PEFT LoRA adapters served beside their base model (vLLM's multi-LoRA).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` as
PEFT's ``save_pretrained`` writes them; it is read here with safetensors alone (no peft
at runtime) and checked against the base model when the worker starts: what is not
served is refused then, with a ``ValueError`` naming the adapter and why (DoRA, biases,
``modules_to_save``, per-module ranks, a target that is not a linear layer of the base
(``nn.Linear``, or GPT-2's ``Conv1D``), the LM head, a rank over ``max_lora_rank``, a
module or shape the base lacks).

A targeted module computes ``W x + scale * B (A x)`` (``scale``: ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``); :class:`Adapter` keeps, per module, ``A``
and ``B`` with the scale folded in. PEFT's ``fan_in_fan_out`` (a ``Conv1D``'s weight is
``inputs x outputs``) changes only how it merges the update into the weight: its ``A`` is
``rank x inputs`` and its ``B`` ``outputs x rank`` either way, and so is the update here.
A fused module (GPT-2's ``c_attn``: q, k and v) has one ``A`` and ``B``, as PEFT saves it.

Two forwards apply them. :class:`~.lean_decode.LeanDecoder` runs a Llama-family layer's
fused products (q, k and v in one; gate and up in one): :func:`fuse` lays an adapter out
that way, the projections' ``A`` concatenated along the rank and their ``B`` placed
block-wise in one ``outputs x ranks`` matrix (zero where a projection is not targeted), so
each product takes one low-rank update per adapter in a step (:func:`apply`). Any other
model, or the same with ``lean_decode`` off, runs transformers' forwards, which
:mod:`.lora_hooks` hooks. A lean engine may fall back to those (its first step failed), so
its adapter keeps both layouts, stored once: each module's ``A`` is a block of rows of its
product's, its ``B`` the block of its product's ``B`` it fills (:func:`fuse`;
:func:`nbytes` counts what is held).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

PROJECTIONS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}  # fmt: skip
"""The projections the lean forward applies an adapter to: each one's fused product and
place in it."""
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}  # fmt: skip
"""The lean decoder's products, each of its projections in output order."""
MAX_RANK = 512
"""The highest ``max_lora_rank`` (vLLM's largest)."""
_KEY = re.compile(r"base_model\.model\.([\w.]+)\.lora_([AB])\.weight")
_LEAN = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")
"""A module path the lean forward knows (a decoder layer's projection)."""
_REFUSED = {"use_dora": "DoRA (use_dora)", "lora_bias": "LoRA biases (lora_bias)",
            "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks "
            "(rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
            "layers_to_transform": "layers_to_transform", "layer_replication":
            "layer_replication", "target_parameters": "target_parameters",
            "trainable_token_indices": "trainable_token_indices"}  # fmt: skip
"""Config entries that, set, ask for more than a plain LoRA of linear layers."""

Update = tuple[torch.Tensor, torch.Tensor]
"""One module's (or fused product's) ``A`` (``ranks x inputs``) and scaled ``B``
(``outputs x ranks``)."""
Fused = tuple[dict[str, Update], ...]
"""An adapter laid out for the lean forward: per decoder layer, its update of each fused
product it targets (:func:`fuse`)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Adapter:
    """One loaded adapter: its update of each module it targets, by the module's path in
    the model (``model.layers.0.self_attn.q_proj``, ``transformer.h.0.attn.c_attn``)."""

    name: str
    rank: int
    scale: float
    modules: dict[str, Update]
    fused: Fused | None = None
    """Its layout for the lean forward (:func:`fuse`; None: not laid out), which
    ``modules`` are then views of."""


def load(name: str, path: str | Path, model: Any, max_rank: int) -> Adapter:
    """Read the adapter at ``path`` for ``model`` (a causal LM), on its device and in its
    dtype; a ``ValueError`` naming it says what is not served (module docstring)."""
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
    return Adapter(name, rank, scale, _modules(tensors, model, rank, scale, refuse))


def _modules(tensors: dict[str, torch.Tensor], model: Any, rank: int, scale: float,
             refuse: Any) -> dict[str, Update]:  # fmt: skip
    """The tensors checked against ``model``'s modules, per module (module docstring)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise refuse(f"weight {key!r} is not a LoRA weight of a linear layer")
        found.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not found:
        raise refuse("adapter_model.safetensors holds no LoRA weights")
    head = model.get_output_embeddings()
    param = next(model.parameters())
    out: dict[str, Update] = {}
    for where, pair in sorted(found.items()):
        try:
            module = model.get_submodule(where)
        except AttributeError:
            raise refuse(f"the base model has no module {where!r} (another base model?)") from None
        if head is not None and module is head:
            raise refuse(f"{where} (the LM head) is not served")
        shape = features(module)
        if shape is None:
            raise refuse(f"{where} is a {type(module).__name__}, not a linear layer")
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise refuse(f"{where}: lora_A and lora_B are not both there")
        want_a, want_b = (rank, shape[0]), (shape[1], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise refuse(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                         f"not fit the base's {want_a} and {want_b} (another base model, or "
                         "another r)")  # fmt: skip
        out[where] = (a.to(param.device, param.dtype).contiguous(),
                      (b * scale).to(param.device, param.dtype).contiguous())  # fmt: skip
    return out


def features(module: Any) -> tuple[int, int] | None:
    """A linear layer's inputs and outputs (None: not one): an ``nn.Linear``'s, or a
    transformers ``Conv1D``'s (GPT-2's; its weight ``inputs x outputs``)."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return int(module.in_features), int(module.out_features)
    if isinstance(module, Conv1D):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def fuse(adapter: Adapter, model: Any) -> Adapter | None:
    """``adapter`` laid out for the lean forward over ``model``'s layers (module docstring):
    its ``fused`` products, per layer, and its ``modules`` views of them (no second copy);
    None where it targets a module that forward does not run as one of its products
    (anything but a decoder layer's seven projections)."""
    base = model.model.layers
    for where in adapter.modules:
        m = _LEAN.fullmatch(where)
        if m is None or m.group(2) not in PROJECTIONS or int(m.group(1)) >= len(base):
            return None
    by_layer: list[dict[str, Update]] = [{} for _ in base]
    views: dict[str, Update] = {}
    for i, layer in enumerate(base):
        for product, projs in FUSED.items():
            paths = [f"model.layers.{i}.{_part(p)}.{p}" for p in projs]
            targeted = [(k, adapter.modules[p]) for k, p in enumerate(paths)
                        if p in adapter.modules]  # fmt: skip
            if not targeted:
                continue
            sizes = [int(getattr(getattr(layer, _part(p)), p).out_features) for p in projs]
            a0, b0 = targeted[0][1]
            rank = a0.shape[0]
            a = a0.new_empty((rank * len(targeted), a0.shape[1]))
            b = b0.new_zeros((sum(sizes), rank * len(targeted)))
            for n, (k, (a_k, b_k)) in enumerate(targeted):
                rows, start = slice(n * rank, (n + 1) * rank), sum(sizes[:k])
                a[rows] = a_k
                b[start : start + sizes[k], rows] = b_k
                views[paths[k]] = (a[rows], b[start : start + sizes[k], rows])
            by_layer[i][product] = (a, b)
    return replace(adapter, modules=views, fused=tuple(by_layer))


def _part(proj: str) -> str:
    return "self_attn" if proj in FUSED["qkv"] or proj == "o_proj" else "mlp"


def nbytes(adapter: Adapter) -> int:
    """The memory ``adapter``'s weights hold: each storage its tensors use, once."""
    tensors = [t for update in adapter.modules.values() for t in update]
    for layer in adapter.fused or ():
        tensors += [t for update in layer.values() for t in update]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def groups(labels: Sequence[int], adapters: Sequence[T],
           device: torch.device) -> list[tuple[T, torch.Tensor]]:  # fmt: skip
    """Tokens (or batch rows) by adapter (``labels``: per one, its adapter's index in
    ``adapters`` plus one; 0: the base model): each adapter used and its indices. Empty
    where none has one."""
    have = np.asarray(labels, dtype=np.int64)
    used = np.unique(have[have > 0])
    return [(adapters[int(a) - 1], torch.from_numpy(np.flatnonzero(have == a)).to(device))
            for a in used]  # fmt: skip


def apply(out: torch.Tensor, x: torch.Tensor, layer: int, fused: str,
          lora: Sequence[tuple[Fused, torch.Tensor]]) -> None:  # fmt: skip
    """Add to ``out`` (``1 x tokens x outputs``: the product ``fused`` of layer ``layer``
    over inputs ``x``, ``1 x tokens x inputs``) each adapter's update on its tokens."""
    for adapter, at in lora:
        update = adapter[layer].get(fused)
        if update is None:
            continue
        a, b = update
        rows = x[0].index_select(0, at)
        out[0].index_add_(0, at, (rows @ a.T) @ b.T)
