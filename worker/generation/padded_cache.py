"""The padded engine's KV cache layers (:mod:`.padded`, and the draft model's, :mod:`.draft`).

- :class:`SlabLayer`: one sequence's cache while it prefills, in a buffer that grows by
  doubling, so each chunk appends in place instead of copying the whole cache;
- :class:`SlotLayer`: one layer of the running batch's cache, a ``rows x width`` buffer in
  which row ``i`` holds sequence ``i``'s keys and values from column 0 and each row writes
  its next token at its own column (the :class:`_Step` shared by every layer says where);
  on CPU it may be a :mod:`.reserve` mapping whose pages go back to the OS.

They live apart from the engine because the draft model's padded batch uses them too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import decode_attention, reserve


class SlabLayer(DynamicLayer):  # type: ignore[misc]
    """A cache layer writing into a preallocated buffer that grows by doubling, so a
    decode step appends in place instead of copying the whole cache (``DynamicLayer``);
    ``reserve``: columns to allocate at once (a prompt's length: no doubling while it
    prefills). Only the columns written are ever read, so the buffer is not zeroed.
    ``dtype``: the buffer's (None: the keys' own; a ``kv_cache_dtype``: what is written
    is rounded to it, and read so)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 length: int = 0, reserve: int = 0,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        self._k = keys
        self._v = values
        self.reserve = reserve
        self.kv_dtype = dtype
        if keys is not None and values is not None:
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.device = keys.device
            self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.get_seq_length()
        q = key_states.shape[-2]
        if self._k is None or self._v is None or n + q > self._k.shape[-2]:
            self._grow(key_states, value_states, n + q)
        assert self._k is not None and self._v is not None
        self._k[:, :, n : n + q].copy_(key_states)
        self._v[:, :, n : n + q].copy_(value_states)
        self.keys, self.values = self._k[:, :, : n + q], self._v[:, :, : n + q]
        self.is_initialized = True
        self.device = self._k.device
        return self.keys, self.values

    def _grow(self, k: torch.Tensor, v: torch.Tensor, need: int) -> None:
        cap = max(need, 2 * (self._k.shape[-2] if self._k is not None else 0), self.reserve, 64)
        n = self.get_seq_length()
        dtype = self.kv_dtype or k.dtype
        new_k = k.new_empty((k.shape[0], k.shape[1], cap, k.shape[3]), dtype=dtype)
        new_v = v.new_empty((v.shape[0], v.shape[1], cap, v.shape[3]), dtype=dtype)
        if n:
            new_k[:, :, :n].copy_(self.keys)
            new_v[:, :, :n].copy_(self.values)
        self._k, self._v = new_k, new_v

    def get_seq_length(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else int(self.keys.shape[-2])


def _cache(
    layers: list[Any] | None = None, reserve: int = 0, dtype: torch.dtype | None = None
) -> Cache:
    """A cache of ``layers``, or one whose :class:`SlabLayer` layers are made as the
    forward reaches them, each reserving ``reserve`` columns of ``dtype``."""
    if layers is None:
        return Cache(layer_class_to_replicate=functools.partial(
            SlabLayer, reserve=reserve, dtype=dtype))  # fmt: skip
    return Cache(layers=layers)


@dataclass(slots=True)
class _Step:
    """What every :class:`SlotLayer` of the batch writes in the current decode."""

    rows: int = 0
    width: int = 0
    """The longest row's length before this token: the mask's past length."""
    positions: torch.Tensor | None = None
    """Per row, the column (= position) its new token goes to."""
    flat: torch.Tensor | None = None
    """Per row and key-value head, where its new token goes in a buffer seen as
    ``(rows * heads * capacity) x head_dim``."""
    capacity: int = 0
    """The buffers' columns when ``flat`` was computed."""


def _flat(states: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """``states`` as contiguous ``n x dim`` rows of ``dtype``: one copy at most (``to``
    returns a strided tensor of the right dtype as it is; ``reshape`` copies it then)."""
    return states.to(dtype, memory_format=torch.contiguous_format).reshape(-1, dim)


class SlotLayer(DynamicLayer):  # type: ignore[misc]
    """One layer of the running batch's KV cache (module docstring): a buffer of
    ``rows x heads x width x head_dim`` that grows by doubling and is kept."""

    def __init__(self, step: _Step) -> None:
        super().__init__()
        self.step = step
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.arrays: tuple[Any, Any] | None = None
        """The buffers as the CPU decode kernel reads them (:func:`.decode_attention.arrays`:
        the same memory), made with them; None where it cannot."""
        self.is_initialized = True

    def reserve(self, like: torch.Tensor, rows: int, width: int) -> None:
        """Room for ``rows`` rows of ``width`` columns (``like``: a ``1 x heads x n x
        head_dim`` cache tensor giving heads, head size, dtype and device: a prefilled
        sequence's, so the buffers keep the ``kv_cache_dtype`` its slab has)."""
        k = self._k
        if k is not None and k.shape[0] >= rows and k.shape[2] >= width:
            return
        old_rows, old_width = (k.shape[0], k.shape[2]) if k is not None else (0, 0)
        shape = (max(rows, old_rows), like.shape[1], max(width, old_width), like.shape[3])
        new_k, new_v = reserve.zeros(shape, like), reserve.zeros(shape, like)
        if self._k is not None and self._v is not None:
            new_k[:old_rows, :, :old_width] = self._k
            new_v[:old_rows, :, :old_width] = self._v
        self._k, self._v = new_k, new_v
        k, v = decode_attention.arrays(new_k), decode_attention.arrays(new_v)
        self.arrays = (k, v) if k is not None and v is not None else None

    def place(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row ``row`` takes a prefilled sequence's cache (``1 x heads x n x head_dim``)."""
        assert self._k is not None and self._v is not None
        n = keys.shape[2]
        self._k[row, :, :n] = keys[0]
        self._v[row, :, :n] = values[0]

    @property
    def mapped(self) -> bool:
        """Whether the buffers are :mod:`.reserve` mappings (their pages can be released)."""
        return self._k is not None and reserve.mapped(self._k)

    def release(self, row: int, start: int) -> int:
        """Hand back the pages of row ``row``'s columns from ``start`` on (they read zero
        afterwards); the bytes released."""
        assert self._k is not None and self._v is not None
        width = int(self._k.shape[2])
        return reserve.release(self._k, row, start, width) + reserve.release(
            self._v, row, start, width
        )

    def move(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Row ``dst`` takes row ``src``'s first ``n`` columns (those from ``start``)."""
        assert self._k is not None and self._v is not None
        self._k[dst, :, start:n] = self._k[src, :, start:n]
        self._v[dst, :, start:n] = self._v[src, :, start:n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.step
        assert self._k is not None and self._v is not None and key_states.shape[2] == 1
        rows, heads, capacity, dim = st.rows, self._k.shape[1], self._k.shape[2], self._k.shape[3]
        if st.flat is None or st.capacity != capacity:  # once per step (all layers alike)
            assert st.positions is not None
            head = torch.arange(heads, device=st.positions.device)
            row = torch.arange(rows, device=st.positions.device)
            st.flat = ((row[:, None] * heads + head[None, :]) * capacity
                       + st.positions[:, None]).reshape(-1)  # fmt: skip
            st.capacity = capacity
        # one row copy per (row, head): index_copy_ on a flat view, not advanced indexing;
        # rounded to the buffers' dtype where it is a kv_cache_dtype (index_copy_ takes one)
        # and made contiguous by that same copy (the rows are strided views of the step's
        # q/k/v: a reshape would copy them once more)
        self._k.view(-1, dim).index_copy_(0, st.flat, _flat(key_states, self._k.dtype, dim))
        self._v.view(-1, dim).index_copy_(0, st.flat, _flat(value_states, self._v.dtype, dim))
        self.keys = self._k[:rows, :, : st.width + 1]
        self.values = self._v[:rows, :, : st.width + 1]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.step.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.step.width + query_length, 0
