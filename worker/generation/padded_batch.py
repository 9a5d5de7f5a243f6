"""The padded engine's running batch (:mod:`.padded`): its rows in the KV buffers.

A prefilled sequence joins as the last row, its cache copied into the row; a row that
leaves takes the last row into its hole (one row copied, never the whole batch); the
buffers grow by doubling, or on CPU are reserved once, given the longest context, and
hand pages back to the OS when the rows hold more written than the KV budget
(:meth:`_Batch._trim`). Each decode first makes room for every row's next token and its
drafts and sets where each row writes (:meth:`_Batch._prepare_decode`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from .padded_cache import SlabLayer, SlotLayer, _cache
from .padded_state import _Seq, _State


class _Batch(_State):
    """The running rows and their KV buffers (module docstring)."""

    def _leave(self, gone: Any) -> None:
        """Rows for which ``gone(row)`` leave; the last row fills each hole."""
        for i in range(len(self._rows) - 1, -1, -1):
            if not gone(self._rows[i]):
                continue
            del self._running[self._rows[i].name]
            last = len(self._rows) - 1
            if i != last:
                n = self._rows[last].context
                for layer in self._layers:
                    layer.move(last, i, n)
                if i < len(self._written):
                    self._written[i] = max(self._written[i], n)
                self._rows[i] = self._rows[last]
                self.moves += 1
            self._rows.pop()

    def _join(self, seq: _Seq) -> None:
        """A prefilled sequence becomes the batch's last row."""
        assert seq.cache is not None
        source = seq.cache.layers
        if not self._layers:
            self._layers = [SlotLayer(self._step) for _ in source]
            self._cache = _cache(self._layers)
        row = len(self._rows)
        cap_rows, cap_width = self._capacity()
        width = seq.context + 1
        if self.max_context is not None:
            rows, width = max(self.max_running, row + 1), max(self.max_context, width)
        else:
            rows = (
                row + 1
                if row < cap_rows
                else max(min(self.max_running, max(8, 2 * cap_rows)), row + 1)
            )
            if width > cap_width:
                width = max(2 * cap_width, 256, width)
        for layer, src in zip(self._layers, source, strict=True):
            layer.reserve(src.keys, rows, width)
            layer.place(row, src.keys[:, :, : seq.context], src.values[:, :, : seq.context])
        if self._layers[0].mapped:
            if len(self._written) < self._capacity()[0]:
                self._written = np.pad(self._written, (0, self._capacity()[0] - len(self._written)))
            self._written[row] = max(self._written[row], seq.context)
        seq.cache = None
        self._rows.append(seq)
        self._running[seq.name] = seq

    def _trim(self) -> None:
        """Where the rows hold more written columns than ``resident_tokens``, release
        pages (module docstring) until a quarter of the budget is free: first the free
        rows', the last first (the batch reaches them last), then those past a running
        sequence's prompt and ``max_new``, most first; then, if still over the budget,
        those past a sequence's context, which it may yet write."""
        limit, written = self.resident_tokens, self._written
        if limit is None or not len(written) or int(written.sum()) <= limit:
            return
        context = np.zeros_like(written)
        reach = np.zeros_like(written)
        n = len(self._rows)
        context[:n] = [r.context for r in self._rows]
        reach[:n] = [r.done + r.max_new for r in self._rows]
        total = int(written.sum())
        for keep, goal in ((np.maximum(context, np.minimum(reach, written)), limit - limit // 4),
                           (context, limit)):  # fmt: skip
            excess = written - keep
            order = sorted(range(len(written)), key=lambda r: (r < n, -r if r >= n else -excess[r]))
            for row in order:
                if total <= goal:
                    break
                if excess[row] <= 0:
                    continue
                for layer in self._layers:
                    self.released_bytes += layer.release(row, int(keep[row]))
                total -= int(excess[row])
                written[row] = keep[row]

    def _capacity(self) -> tuple[int, int]:
        k = self._layers[0]._k if self._layers else None
        return (0, 0) if k is None else (int(k.shape[0]), int(k.shape[2]))

    def _prepare_decode(self, drafts: dict[int, list[int]]) -> tuple[torch.Tensor, np.ndarray]:
        """Room for every row's next token and its ``drafts`` (by row), and the step's
        write positions set; each row's position and key count (with its new token)."""
        rows = len(self._rows)
        lengths = [r.context for r in self._rows]
        ends = np.asarray(lengths) + 1
        for i, d in drafts.items():
            ends[i] += len(d)
        width = max(lengths)
        if int(ends.max()) > self._capacity()[1]:
            grow_to = max(2 * self._capacity()[1], int(ends.max()))
            for layer in self._layers:
                assert layer._k is not None
                layer.reserve(layer._k[:1], rows, grow_to)
        if len(self._written):
            w = self._written[:rows]
            np.maximum(w, ends, out=w)  # the columns after this write
        positions = torch.tensor(lengths, device=self.device)
        st = self._step
        st.rows, st.width, st.positions, st.flat = rows, width, positions, None
        return positions, np.asarray(lengths, dtype=np.int64) + 1

    def _row_cache(self, row: int) -> Cache:
        """Row ``row``'s KV as a cache for a chunk of drafts after its decode token: a
        view of its buffer row, which the chunk's keys and values are written into."""
        n = self._rows[row].context + 1
        layers = []
        for layer in self._layers:
            assert layer._k is not None and layer._v is not None
            layers.append(SlabLayer(layer._k[row : row + 1], layer._v[row : row + 1], n))
        return _cache(layers)
