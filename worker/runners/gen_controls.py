"""The text-generation runner's operator controls while it serves: LoRA adapters loaded
and unloaded (control commands, applied between steps), their requests and memory (read
at a metrics scrape), and the prefix cache emptied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from ..runner import Prepared
from .gen_state import RunnerState

logger = logging.getLogger(__name__)


class Controls(RunnerState):
    """Adapters and the prefix cache, changed while the runner serves."""

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The names of the LoRA adapters a new request may ask for now."""
        return self._loras.names

    @property
    def max_loras(self) -> int:
        return self._loras.max_loras

    def load_lora(self, name: str, path: str | Path) -> None:
        """Any thread but the device's (a control command's): read and check the adapter at
        ``path`` as at startup (a ``ValueError`` says what is refused; nothing changes
        then) and hand it to the device thread, which serves it from its next step on."""
        from ..generation.lora import load as load_adapter

        self._loras.reserve(name)
        try:
            adapter = self.engine.fuse_adapter(
                load_adapter(name, path, self.model, self.max_lora_rank)
            )
        except ValueError as exc:
            self._loras.release(name)
            raise ValueError(str(exc).removeprefix("options.lora_adapters: ")) from None
        except BaseException:
            self._loras.release(name)
            raise
        self._loras.add(name, adapter)

    def unload_lora(self, name: str) -> None:
        """Any thread: no new request may name ``name`` (``invalid_request``); those
        already started under it end under it (vLLM's: a running request keeps its
        adapter), then its memory goes. A ``ValueError`` where it is not loaded."""
        self._loras.remove(name)

    def lora_requests(
        self, queued: Iterable[tuple[str, str | None]] = ()
    ) -> dict[str, tuple[int, int]]:
        """Any thread: per adapter a new request may name, its requests running and waiting
        here (preempted, waiting for a constraint, or ``queued``: ``(key, adapter)`` of
        those its loop read and has not admitted yet); read at a metrics scrape."""
        names = {label: name for name, label in self._loras.labels.items()}
        out = dict.fromkeys(names.values(), (0, 0))
        reqs = dict(self._reqs)
        for key, lora in queued:
            if lora in out and key not in reqs:  # (a preempted one: counted below)
                running, waiting = out[lora]
                out[lora] = (running, waiting + 1)
        for r in reqs.values():
            name = names.get(r.spec.lora)
            if name is not None:
                running, waiting = out[name]
                if r.parked or r.compiling is not None:
                    out[name] = (running, waiting + 1)
                else:
                    out[name] = (running + 1, waiting)
        return out

    def lora_bytes(self) -> dict[str, int]:
        """Any thread: per adapter the engine holds (an unloaded one until its requests
        end), the memory its weights take (:func:`..generation.lora.nbytes`); read at a
        metrics scrape."""
        from ..generation.lora import nbytes

        out: dict[str, int] = {}
        for a in self.engine.adapters:
            if a is not None:  # (a name reloaded while its old weights drain: both)
                out[a.name] = out.get(a.name, 0) + nbytes(a)
        return out

    def _lora_changes(self) -> None:
        """Between steps: the adapters loaded since put in the engine, and those unloaded
        taken out of it once none of their requests is left."""
        engine = self.engine
        for change in self._loras.take():
            if change.adapter is not None:
                engine.set_adapter(change.label, change.adapter)
                logger.info("LoRA adapter %r loaded (label %d)", change.adapter.name, change.label)
            else:
                self._draining_loras.add(change.label)
        if self._draining_loras:
            used = {r.spec.lora for r in self._reqs.values()}
            for label in sorted(self._draining_loras - used):
                engine.set_adapter(label, None)
                self._draining_loras.discard(label)
                logger.info("LoRA adapter of label %d unloaded", label)
        self._loras.settled(bool(self._draining_loras))

    def _lora_live(self, prep: Prepared) -> bool:
        """Whether a new request's adapter may start (not unloaded since it was read). One
        read with it was loaded before: before its step began, which put it in the engine."""
        return prep.payload.lora in self._loras.labels.values()

    def reset_prefix_cache(self) -> bool:
        """Any thread: empty the prefix cache before the next step (vLLM's
        ``reset_prefix_cache``), so no prompt admitted after this call takes a block held
        before it; running sequences keep their own keys and values (blocks are copies;
        the paged engine's shared blocks stay with their users). False: the model has no
        prefix cache (``prefix_cache_tokens`` 0; the paged engine, a sliding-window model)."""
        from ..generation.paged import PagedEngine

        if isinstance(self.engine, PagedEngine):
            if not self.engine.sharing.on:
                return False
        elif self.prefix_cache_tokens == 0:
            return False
        self._reset_prefix = True
        return True

    def _empty_prefix_cache(self) -> None:
        from ..generation.padded import PaddedEngine
        from ..generation.paged import PagedEngine

        if isinstance(self.engine, PaddedEngine) and self.engine.prefix is not None:
            logger.info("prefix cache emptied (%d tokens held)", self.engine.prefix.tokens)
            self.engine.prefix.clear()
        elif isinstance(self.engine, PagedEngine):
            logger.info("shared blocks forgotten (%d blocks)", self.engine.forget_blocks())
