"""Images for the vision runners: decode and preprocess one image on the CPU side, collate a
batch into reused host buffers on the device side.

Two kinds of image processor:

- **fixed size** (ViT, CLIP, SigLIP): every image is resized to the same ``(C, H, W)``; a
  row costs the model's patch count, the same for all.
- **native resolution** (SigLIP 2 "NaFlex": the processor returns ``pixel_attention_mask``
  and ``spatial_shapes``): an image becomes a sequence of patches whose count follows its
  size and aspect ratio. A batch is padded to its longest sequence, with a mask, so a row
  costs its patch count and the batching engine groups similar sizes as it groups texts
  of similar length. Option ``keep_native_resolution`` (default false): images smaller than
  the model's patch budget keep their size (fewer patches) instead of being scaled up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoImageProcessor

from ...schemas.inputs import DEFAULT_INPUT_LIMITS, AnyInput, InputLimits
from ..device import to_device
from ..host_buffers import HostBuffers
from ..images import decode_image

MIN_NATIVE_PATCHES = 16
"""A native-resolution image gets at least this many patches (a 4x4 grid)."""


@dataclass(frozen=True, slots=True)
class PixelRow:
    """One preprocessed image: ``(C, H, W)`` pixels, or ``(patches, C·p·p)`` with its patch
    grid ``(rows, cols)`` for a native-resolution processor."""

    pixels: np.ndarray
    grid: tuple[int, int] | None
    tokens: int
    """Patches the model computes over (the batching cost feature)."""
    truncated: bool = False


class ImagePrep:
    """An image processor loaded from a model directory, and the host buffers its batches
    are collated into."""

    def __init__(
        self,
        path: str | Path,
        config: Any,
        device: torch.device,
        dtype: torch.dtype,
        options: dict[str, Any],
    ) -> None:
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.native = "spatial_shapes" in getattr(self.processor, "model_input_names", ())
        self.keep_native = bool(options.get("keep_native_resolution", False)) and self.native
        self.device = device
        self.dtype = dtype
        self.limits: InputLimits = DEFAULT_INPUT_LIMITS
        vision = getattr(config, "vision_config", config)
        self.patch = int(getattr(self.processor, "patch_size", None) or vision.patch_size)
        self.max_patches = int(getattr(self.processor, "max_num_patches", 0) or 0)
        pinned = device.type == "cuda"
        self._pixels = HostBuffers(["pixel_values"], pinned=pinned, dtype=torch.float32)
        self._masks = HostBuffers(["pixel_attention_mask"], pinned=pinned)
        self._grids = HostBuffers(["spatial_shapes"], pinned=pinned, initial=64)

    @property
    def allocations(self) -> int:
        """Host buffer allocations so far (flat in steady state)."""
        return self._pixels.allocations + self._masks.allocations + self._grids.allocations

    def prepare(self, item: AnyInput, where: str) -> PixelRow:
        """Decode (bounded: :func:`decode_image`) and preprocess one image input."""
        image = decode_image(item, self.limits, where)
        if not self.native:
            pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
            _, h, w = pixels.shape
            return PixelRow(pixels.astype(np.float32, copy=False), None, self._fixed_tokens(h, w))
        budget = self.max_patches
        if self.keep_native:
            own = math.ceil(image.width / self.patch) * math.ceil(image.height / self.patch)
            budget = max(MIN_NATIVE_PATCHES, min(budget, own))
        out = self.processor(images=[image], return_tensors="np", max_num_patches=budget)
        n = int(out["pixel_attention_mask"][0].sum())
        gh, gw = (int(x) for x in out["spatial_shapes"][0])
        pixels = out["pixel_values"][0, :n].astype(np.float32, copy=False)
        return PixelRow(pixels, (gh, gw), n)

    def _fixed_tokens(self, h: int, w: int) -> int:
        return (h // self.patch) * (w // self.patch) + 1  # + the class token

    def collate(self, rows: list[PixelRow]) -> dict[str, torch.Tensor]:
        """The model's image inputs for ``rows``, in reused host buffers copied to the
        device; native-resolution rows padded to the longest, with a mask."""
        if not self.native:
            views = self._pixels.take_shape((len(rows), *rows[0].pixels.shape))
            batch = views["pixel_values"]
            np_batch = batch.numpy()
            for i, row in enumerate(rows):
                np_batch[i] = row.pixels
            return {"pixel_values": to_device(batch, self.device).to(self.dtype)}
        width = max(r.tokens for r in rows)
        dim = rows[0].pixels.shape[1]
        pixels = self._pixels.take_shape((len(rows), width, dim))["pixel_values"]
        mask = self._masks.take(len(rows), width)["pixel_attention_mask"]
        grids = self._grids.take(len(rows), 2)["spatial_shapes"]
        np_pixels, np_mask, np_grids = pixels.numpy(), mask.numpy(), grids.numpy()
        np_pixels.fill(0.0)
        np_mask.fill(0)
        for i, row in enumerate(rows):
            np_pixels[i, : row.tokens] = row.pixels
            np_mask[i, : row.tokens] = 1
            np_grids[i] = row.grid
        return {
            "pixel_values": to_device(pixels, self.device).to(self.dtype),
            "pixel_attention_mask": to_device(mask, self.device),
            "spatial_shapes": to_device(grids, self.device),
        }


class TakesImages:
    """Mixin of the runners that decode images: the model's input limits reach their
    :class:`ImagePrep` (the worker sets ``input_limits`` from the fleet file)."""

    images: ImagePrep

    @property
    def input_limits(self) -> InputLimits:
        return self.images.limits

    @input_limits.setter
    def input_limits(self, limits: InputLimits) -> None:
        self.images.limits = limits
