"""Reusable host-side input buffers: one allocation that grows, not fresh tensors per batch.

On CUDA the buffers are pinned, so the host→device copy is asynchronous (DMA) and no
pinned staging copy is made per batch. ``allocations`` counts the allocations made: in
steady state (batches no bigger than one seen before) it stays put.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class HostBuffers:
    """Named flat buffers (int64 by default) handed out as contiguous views."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        pinned: bool = False,
        initial: int = 4096,
        dtype: torch.dtype = torch.long,
    ) -> None:
        self.names = tuple(names)
        self.pinned = pinned
        self.dtype = dtype
        self.allocations = 0
        """Times the buffers were (re)allocated: once at start, then only to grow."""
        self._flat: dict[str, torch.Tensor] = {}
        self._allocate(initial)

    @property
    def capacity(self) -> int:
        """Elements each buffer holds now (rows x width of the largest batch so far)."""
        return int(next(iter(self._flat.values())).numel())

    def _allocate(self, elements: int) -> None:
        self._flat = {
            name: torch.empty(elements, dtype=self.dtype, pin_memory=self.pinned)
            for name in self.names
        }
        self.allocations += 1

    def take(self, rows: int, width: int) -> dict[str, torch.Tensor]:
        """Views of shape ``(rows, width)`` over the buffers (contents undefined)."""
        return self.take_shape((rows, width))

    def take_shape(self, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Views of ``shape`` over the buffers (contents undefined)."""
        need = math.prod(shape)
        if need > self.capacity:
            self._allocate(max(need, 2 * self.capacity))
        return {name: flat[:need].view(shape) for name, flat in self._flat.items()}
