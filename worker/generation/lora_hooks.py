"""LoRA adapters on transformers' own forwards (any model family; :mod:`.lora`).

The padded engine's transformers forwards are either one prefill chunk (one batch row, one
sequence) or one decode over the running rows (one token a row): batch row ``i`` of a
forward is one sequence, under one adapter. Before such a forward the engine says which
(:meth:`LoraHooks.rows`); while it runs, a forward hook on each module the used adapters
target adds ``(x @ A^T) @ B^T`` (scale folded into ``B``) to that module's output on
each adapter's rows. The hooks are attached for that forward alone and removed after it,
so a forward with no adapter row runs the modules as they are, with no hook to call (the
base model's speed). Dimension 0 of a hooked module's input and output is the batch row;
a module that flattens the tokens first still has one per row (a decode's one token), or
one sequence's (a prefill chunk's).

The paged engine's forward is one batch row of every sequence's tokens side by side: it
gives a label per token (``tokens=True``), and the hooks index a module's input and
output with their leading dimensions flattened (a linear layer's: one row a token).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .lora import Adapter, groups


class LoraHooks:
    """The engine's adapters on ``model``'s modules, for the forwards it says."""

    def __init__(self, model: Any, adapters: Sequence[Adapter | None]) -> None:
        self.adapters = tuple(adapters)
        """By label less one (None: a label taken away)."""
        self.device = next(model.parameters()).device
        self._modules = {where: model.get_submodule(where)
                         for a in self.adapters if a is not None for where in a.modules}  # fmt: skip
        """Every targeted module, by its path."""
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []
        """The current forward's rows by adapter (None: all its rows)."""
        self._rows = 0
        self._tokens = False
        """The labels are per token, not per batch row (module docstring)."""

    @contextmanager
    def rows(self, labels: Sequence[int], tokens: bool = False) -> Iterator[None]:
        """During the block, forward batch row ``i`` (``tokens``: the forward's token ``i``,
        batch and sequence flattened) runs under adapter ``labels[i]`` (an index into
        ``adapters`` plus one; 0: the base model). No adapter: nothing done."""
        used = set(labels) - {0}
        if not used:
            yield
            return
        if len(used) == 1 and 0 not in labels:
            only = self.adapters[used.pop() - 1]
            self._groups = [] if only is None else [(only, None)]
        else:
            self._groups = [(a, at) for a, at in groups(labels, self.adapters, self.device)
                            if a is not None]  # fmt: skip
        self._rows, self._tokens = len(labels), tokens
        wanted = {where for a, _ in self._groups for where in a.modules}
        handles = [self._modules[where].register_forward_hook(self._hook(where))
                   for where in sorted(wanted)]  # fmt: skip
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._groups, self._rows, self._tokens = [], 0, False

    def _hook(self, where: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            x, y = args[0], out
            if self._tokens:  # one row a token: views of the same memory
                x, y = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            for adapter, at in self._groups:
                update = adapter.modules.get(where)
                if update is None:
                    continue
                a, b = update
                if at is None:
                    y.add_((x @ a.T) @ b.T)
                    continue
                if y.shape[0] != self._rows:
                    raise RuntimeError(f"LoRA: {where}'s output has {y.shape[0]} rows, the "
                                       f"forward {self._rows}")  # fmt: skip
                y.index_add_(0, at, (x.index_select(0, at) @ a.T) @ b.T)
            return out

        return hook
