"""Reusable host-side input buffers: one allocation that grows, not fresh tensors per batch.

On CUDA the buffers are pinned, so the host→device copy is asynchronous (DMA) and no
pinned staging copy is made per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostBuffers:
    """Named flat int64 buffers handed out as contiguous ``(rows, width)`` views."""

    def __init__(self, names: Sequence[str], *, pinned: bool = False, initial: int = 4096) -> None:
        self.names = tuple(names)
        self.pinned = pinned
        self._flat: dict[str, torch.Tensor] = {}
        self._allocate(initial)

    @property
    def capacity(self) -> int:
        """Elements each buffer holds now (rows x width of the largest batch so far)."""
        return int(next(iter(self._flat.values())).numel())

    def _allocate(self, elements: int) -> None:
        self._flat = {
            name: torch.empty(elements, dtype=torch.long, pin_memory=self.pinned)
            for name in self.names
        }

    def take(self, rows: int, width: int) -> dict[str, torch.Tensor]:
        """Views of shape ``(rows, width)`` over the buffers (contents undefined)."""
        need = rows * width
        if need > self.capacity:
            self._allocate(max(need, 2 * self.capacity))
        return {name: flat[:need].view(rows, width) for name, flat in self._flat.items()}
