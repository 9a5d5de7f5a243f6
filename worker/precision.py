"""A float32 model's linear layers at a lower precision (the runners' ``matmul_precision``).

The option takes ``torch.set_float32_matmul_precision``'s names, and applies per model:

- ``highest`` (the default): nothing changes.
- ``high``: on CUDA, TF32 products (``torch.backends.cuda.matmul.allow_tf32``: a
  process-wide switch, so every float32 model of the worker's process gets them). CPUs
  have no TF32: as ``highest``.
- ``medium``: every plain ``nn.Linear`` of the model (the decoder layers' projections
  and the LM head; an encoder's layers and heads) and GPT-2's ``Conv1D`` keeps its weight
  in bfloat16 (converted once, the float32 copy freed unless something else, a tied
  embedding, holds it) and computes ``x`` rounded to bfloat16 times that weight, its
  result rounded to bfloat16 (as under ``torch.autocast``: the sums run in float32), then
  back to float32, the bias (kept in float32) added after. The residual stream, norms,
  embeddings, attention and the KV cache stay float32, and so do subclasses of
  ``nn.Linear`` (quantized layers; ``nn.MultiheadAttention``'s ``out_proj``, whose weight
  that module multiplies by itself). It pays where a step is GEMM-bound (many rows a
  step: batched decodes, prefill) on a device with fast bfloat16 products (a CPU with
  ``avx512_bf16`` or AMX, an Ampere or later GPU); a product of a row or two costs more
  than in float32 (oneDNN's fixed cost per bfloat16 call). Where bfloat16 is emulated it
  is slower still: a warning is logged and the model stays float32.

A model of another dtype has nothing to change (one info line says so). The conversion
lives in the model's own modules, so every forward of it (the engines', ``generate``,
a LoRA hook's) gets the same products; :func:`linear` is the product itself, for code that
multiplies by a module's weight directly (:mod:`.generation.lean_decode`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

logger = logging.getLogger(__name__)

PRECISIONS = ("highest", "high", "medium")
"""The values of ``matmul_precision`` (``torch.set_float32_matmul_precision``'s)."""
_CPU_BF16 = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""``torch.cpu.get_capabilities()`` flags of native bfloat16 dot products (x86, Arm)."""


def read(value: Any) -> str:
    """``options.matmul_precision`` checked (None: ``highest``); a ``ValueError`` names it."""
    if value is None:
        return "highest"
    if value not in PRECISIONS:
        raise ValueError(f"options.matmul_precision: {value!r} is not one of "
                         f"{', '.join(PRECISIONS)}")  # fmt: skip
    return str(value)


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively (not emulated through float32)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type != "cpu":
        return False
    try:
        caps = torch.cpu.get_capabilities()
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and any(
            caps.get(flag, False) for flag in _CPU_BF16
        )
    except (AttributeError, RuntimeError):  # an older torch: no way to tell
        return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """``x @ weight.T + bias`` with the product in ``weight``'s dtype: where that is not
    ``x``'s, ``x`` rounded to it, the product's result cast to ``dtype`` (default ``x``'s)
    and ``bias`` added in that dtype (module docstring)."""
    if weight.dtype == x.dtype and (dtype is None or dtype == x.dtype):
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).to(dtype or x.dtype)
    return out if bias is None else out.add_(bias)


class MixedLinear(torch.nn.Linear):  # type: ignore[misc]
    """An ``nn.Linear`` whose weight is bfloat16 and whose result is float32
    (:func:`linear`); made by :func:`to_bf16` from a plain one."""

    out_dtype: torch.dtype = torch.float32

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias, self.out_dtype)


class MixedConv1D(Conv1D):  # type: ignore[misc]
    """GPT-2's ``Conv1D`` (weight ``inputs x outputs``, kept so) as :class:`MixedLinear`."""

    out_dtype: torch.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = linear(x.reshape(-1, x.shape[-1]), self.weight.T, self.bias, self.out_dtype)
        return flat.view(*x.shape[:-1], self.nf)


_MIXED: dict[type, type] = {torch.nn.Linear: MixedLinear, Conv1D: MixedConv1D}
"""The module types converted (exactly these: a subclass, quantized or adapted, is
left as it is) and what each becomes."""


def to_bf16(model: torch.nn.Module) -> int:
    """Convert every float32 linear layer of ``model`` in place (module docstring): its
    weight to bfloat16 (a weight shared by layers converted once, still shared), its class
    to the mixed one, so hooks and references to it stay valid. The layers converted."""
    done: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}
    count = 0
    for module in model.modules():
        kind = _MIXED.get(type(module))
        weight = getattr(module, "weight", None)
        if kind is None or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
            continue
        if id(weight) not in done:  # the old one kept alive until the end: ids stay unique
            half = weight.detach().to(torch.bfloat16)
            done[id(weight)] = (weight, torch.nn.Parameter(half, weight.requires_grad))
        module.weight = done[id(weight)][1]
        module.__class__ = kind
        count += 1
    return count


def apply(model: torch.nn.Module, precision: str, device: torch.device, what: str) -> str:
    """Set ``model`` (``what``: its name, for the log) on ``device`` to ``precision``
    (module docstring); the precision in effect: ``highest`` where there was nothing to
    do (another dtype, no TF32 on a CPU, no fast bfloat16)."""
    if precision == "highest":
        return precision
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype != torch.float32:
        logger.info("%s: matmul_precision %s has nothing to do: its dtype is %s, not float32",
                    what, precision, dtype)  # fmt: skip
        return "highest"
    if precision == "high":
        if device.type != "cuda":
            logger.info("%s: matmul_precision high: no TF32 on %s, products stay float32",
                        what, device.type)  # fmt: skip
            return "highest"
        torch.backends.cuda.matmul.allow_tf32 = True  # process-wide, as torch's switch is
        return precision
    if not fast_bf16(device):
        logger.warning("%s: matmul_precision medium is off: %s has no fast bfloat16 "
                       "products (emulated, slower than float32); products stay float32",
                       what, device)  # fmt: skip
        return "highest"
    layers = to_bf16(model)
    logger.info("%s: matmul_precision medium: %d linear layers multiply in bfloat16",
                what, layers)  # fmt: skip
    return precision
