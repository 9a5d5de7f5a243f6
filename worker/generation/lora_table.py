"""A generating runner's LoRA adapters by name, changed while it serves (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; ``bf_load_lora``,
``bf_unload_lora``).

An adapter is read and checked off the device thread (the control command's), then handed
here; the device thread takes the changes between two steps (:meth:`AdapterTable.take`)
and puts them in the engine, the one owner of what a step reads. Names map to labels (an
index into the engine's adapters, plus one) that are never given twice: a prefix cached
under an unloaded adapter's label is never found by another adapter's prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .lora import Adapter

MAX_LORAS = 8
"""The default bound on adapters loaded at once (vLLM's ``max_loras`` is 1; its servers
with several adapters set more)."""


class AdapterLoaded(ValueError):
    """The name is loaded already (or being loaded)."""

    code = "already_loaded"


class AdapterNotLoaded(ValueError):
    """The name is not loaded."""

    code = "not_loaded"


@dataclass(frozen=True, slots=True)
class Change:
    """An adapter added at ``label`` (as its engine serves it), or (``adapter`` None) one
    unloaded: its label takes no new request, and goes once none of its requests is left."""

    label: int
    adapter: Adapter | None


class AdapterTable:
    """Names to labels: read by any thread (each change replaces the dict), changed under a
    lock; the changes wait for the device thread (:meth:`take`)."""

    def __init__(self, names: Sequence[str], max_loras: int = MAX_LORAS) -> None:
        if len(names) > max_loras:
            raise ValueError(f"options.lora_adapters: {len(names)} adapters, over max_loras "
                             f"{max_loras}")  # fmt: skip
        self.max_loras = max_loras
        self.labels: dict[str, int] = {n: i + 1 for i, n in enumerate(names)}
        """The adapters a new request may name, and their labels."""
        self._next = len(names) + 1
        self._loading: set[str] = set()
        self._changes: list[Change] = []
        self._lock = threading.Lock()
        self.pending = False
        """Changes wait for the device thread, or an unloaded adapter for its requests to
        end: the one thing a step reads of this table (nothing more when unchanged)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.labels)

    def reserve(self, name: str) -> None:
        """Before an adapter is read: refuse a name loaded (or loading), or a full table."""
        if not isinstance(name, str) or not 0 < len(name) <= 128:
            raise ValueError(f"lora name {name!r}: 1-128 characters")
        with self._lock:
            if name in self.labels or name in self._loading:
                raise AdapterLoaded(f"adapter {name!r} is already loaded (unload it first)")
            if len(self.labels) + len(self._loading) >= self.max_loras:
                raise ValueError(f"{len(self.labels)} adapters are loaded, max_loras "
                                 f"{self.max_loras}: unload one first")  # fmt: skip
            self._loading.add(name)

    def release(self, name: str) -> None:
        """A reserved name whose adapter was refused."""
        with self._lock:
            self._loading.discard(name)

    def add(self, name: str, adapter: Adapter) -> int:
        """A reserved name's adapter, read and checked: served from the next step on; its
        label."""
        with self._lock:
            self._loading.discard(name)
            label, self._next = self._next, self._next + 1
            self._changes.append(Change(label, adapter))
            self.labels = {**self.labels, name: label}
            self.pending = True
        return label

    def remove(self, name: str) -> int:
        """No new request may name ``name`` from now on; its label."""
        with self._lock:
            if name not in self.labels:
                known = ", ".join(self.labels) or "none"
                raise AdapterNotLoaded(f"adapter {name!r} is not loaded (loaded: {known})")
            labels = dict(self.labels)
            label = labels.pop(name)
            self.labels = labels
            self._changes.append(Change(label, None))
            self.pending = True
        return label

    def take(self) -> list[Change]:
        """The device thread, between steps: the changes since the last take."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def settled(self, draining: bool) -> None:
        """The device thread, after :meth:`take`: ``draining``, an unloaded adapter still
        has requests (looked at again at the next step)."""
        with self._lock:
            self.pending = draining or bool(self._changes)
