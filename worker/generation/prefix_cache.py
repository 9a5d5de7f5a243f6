"""Keys and values of recent prompts' leading blocks, so that a prompt beginning the same
way (a shared system prompt, a conversation's earlier turns, a preempted sequence coming
back) prefills only what follows them: vLLM's automatic prefix caching, for the padded
engine.

A prompt is cut into blocks of ``block`` tokens; each block is known by a hash chained
over every token before its end, so a block is found only after the same whole prefix.
Its tokens are kept too, and compared, so a hash collision never lends wrong keys. A
lookup walks a prompt's blocks while they are held and returns the longest such prefix
that leaves at least one token to prefill (its logits give the first new token).

A prompt may carry a salt (vLLM's ``cache_salt``): its chain of hashes starts from it,
and its blocks are found only by prompts with the same salt, so a tenant cannot tell
from how fast its prompt was answered whether another tenant's prompt began the same
way (the salt is kept with each block and compared, as the tokens are).

Blocks are evicted least recently used first, within ``capacity`` tokens. A lookup or a
store touches a prompt's blocks last to first, so a block is always more recent than
the blocks after it in any prompt: eviction takes a prompt's tail before its head, and a
block held is reachable.

Held blocks cost memory beyond the engine's KV budget: ``capacity`` tokens of keys and
values (per token ``2 x layers x kv_heads x head_dim`` numbers of the KV cache's dtype:
the model's, or the engine's ``kv_cache_dtype``);
each block is a copy of its own, freed when it is evicted (a store and a lookup cost about
half a millisecond for a 512-token prompt of the benchmark's tiny model on this CPU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, keys and values: ``1 x kv_heads x tokens x head_dim``."""

Salt = str | tuple[str | None, int] | None
"""A prompt's ``cache_salt``; with a LoRA adapter, ``(cache_salt, adapter)``: keys and
values computed under an adapter are never lent to another adapter's prompt, nor to the
base model's."""

Stacked = tuple[torch.Tensor, torch.Tensor]
"""Keys and values of every layer: ``layers x 1 x kv_heads x tokens x head_dim``."""


@dataclass(frozen=True, slots=True)
class _Block:
    tokens: tuple[int, ...]
    salt: Salt
    kv: Stacked
    """Its keys and values, all layers in one tensor each (two copies a block, not two a
    layer: a store's cost is in the number of copies)."""


class PrefixCache:
    """One model's held prompt blocks (module docstring). Not thread-safe: the device
    thread owns it."""

    def __init__(self, capacity: int, block: int = 32) -> None:
        if block < 1 or capacity < 0:
            raise ValueError(f"prefix cache: block {block}, capacity {capacity}")
        self.capacity = capacity
        self.block = block
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self.hit_tokens = 0
        """Prompt tokens lookups found so far (each one prefill token saved)."""

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return len(self._blocks) * self.block

    def _hashes(self, tokens: Sequence[int], blocks: int, salt: Salt) -> list[int]:
        out: list[int] = []
        h = 0 if salt is None else hash(("salt", salt))
        b = self.block
        for i in range(blocks):
            h = hash((h, tuple(tokens[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def _found(self, tokens: Sequence[int], salt: Salt) -> list[tuple[int, _Block]]:
        b = self.block
        found: list[tuple[int, _Block]] = []
        for i, h in enumerate(self._hashes(tokens, (len(tokens) - 1) // b, salt)):
            block = self._blocks.get(h)
            if (block is None or block.salt != salt
                    or block.tokens != tuple(tokens[i * b : (i + 1) * b])):  # fmt: skip
                break
            found.append((h, block))
        return found

    def peek(self, tokens: Sequence[int], salt: Salt = None) -> int:
        """How long a prefix of ``tokens`` :meth:`lookup` would find now (touching nothing:
        an estimate of the prefill a waiting prompt will need)."""
        return len(self._found(tokens, salt)) * self.block

    def lookup(self, tokens: Sequence[int], salt: Salt = None) -> tuple[int, Stacked | None]:
        """The longest held prefix of ``tokens`` (block by block) with the same ``salt``
        that leaves at least one token to prefill: its length and its keys and values
        (None: nothing held)."""
        b = self.block
        found = self._found(tokens, salt)
        for h, _ in reversed(found):
            self._blocks.move_to_end(h)
        self.hit_tokens += len(found) * b
        if not found:
            return 0, None
        if len(found) == 1:
            return b, found[0][1].kv
        keys = torch.cat([block.kv[0] for _, block in found], dim=3)
        return len(found) * b, (keys, torch.cat([block.kv[1] for _, block in found], dim=3))

    def store(self, tokens: Sequence[int], kv: KV, salt: Salt = None) -> int:
        """Hold the whole blocks of a prefilled prompt (``kv``: its cache, per layer, at
        least ``len(tokens)`` columns; ``salt``: its ``cache_salt``) that are not held yet;
        how many new blocks. A model whose layers' caches differ in shape is not cached."""
        b = self.block
        if self.capacity < b or not kv or any(k.shape[1:] != kv[0][0].shape[1:] for k, _ in kv):
            return 0
        blocks = min(len(tokens) // b, self.capacity // b)
        hashes = self._hashes(tokens, blocks, salt)
        missing = [
            i for i, h in enumerate(hashes)
            if (held := self._blocks.get(h)) is None or held.salt != salt
            or held.tokens != tuple(tokens[i * b : (i + 1) * b])
        ]  # fmt: skip
        for i in missing:  # each block its own copy: freed when it is evicted
            cut = slice(i * b, (i + 1) * b)
            keys = torch.stack([k[:, :, cut] for k, _ in kv])
            values = torch.stack([v[:, :, cut] for _, v in kv])
            self._blocks[hashes[i]] = _Block(tuple(tokens[cut]), salt, (keys, values))
        for h in reversed(hashes):
            self._blocks.move_to_end(h)
        while self.tokens > self.capacity:
            self._blocks.popitem(last=False)
        return len(missing)

    def clear(self) -> None:
        self._blocks.clear()
