"""Prefix caching on the paged engine (:mod:`.paged`): transformers' block sharing, salted.

transformers' paged cache (``allow_block_sharing``) hashes every block a forward fills,
chained over the blocks before it (``compute_block_hash``), and a new prompt takes the
blocks of its longest hashed prefix that leaves one token to prefill (its scheduler's
``search_prefix_match``), sharing them by reference count. A block no sequence holds any
more stays in the pool's ledger, findable, until the cache runs short (it then evicts
them all, ``evict_cached_blocks``). Forks share their parent's full blocks.

What transformers lacks, :class:`SaltedSharing` adds on the cache it is given:

- a salt per sequence (``cache_salt``, and its LoRA adapter): the chain of a salted
  sequence's hashes starts from the salt's own hash instead of nothing, so its blocks are
  found only by sequences with the same salt (blake2b, 64 bits, as transformers' own);
- sequences that take no prefix (their prompt is scored: a shared block has no logits);
- per sequence, the prompt tokens it took (OpenAI's ``cached_tokens``);
- cached blocks evicted when a sequence's next blocks do not fit beside them (transformers
  evicts only under its safety margin; the worker's scheduler leaves it none).

Only caches whose every layer group can share (full attention) share: a sliding-window
layer keeps a ring buffer (token ``p`` at slot ``p % window``, overwritten as the sequence
goes on), so a block of it does not keep what a later prompt would read, and transformers
turns sharing off for any model with such a layer (``use_prefix_sharing``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (
    compute_block_hash,
)

Salt = tuple[str | None, int, int] | str | None
"""A sequence's ``cache_salt``; under a LoRA adapter, ``(cache_salt, label, epoch)``: the
adapter's label and how many times that label was given an adapter."""


def seed(salt: Salt) -> int | None:
    """The parent hash a salted chain starts from (None: transformers' own, unsalted)."""
    if salt is None:
        return None
    digest = hashlib.blake2b(repr(("salt", salt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=False)


def match(allocator: Any, prompt: list[int], start: int | None) -> list[int]:
    """The allocator's hashed blocks of the longest prefix of ``prompt`` (leaving one token)
    whose chain starts at ``start`` (transformers' ``match_prefix_blocks``, seeded)."""
    page = allocator.tokens_per_page
    found: list[int] = []
    h = start
    for b in range((len(prompt) - 1) // page):
        h = compute_block_hash(h, prompt[b * page : (b + 1) * page])
        block = allocator.ledger.hash_to_block.get(h)
        if block is None:
            break
        found.append(block)
    return found


def mark(allocator: Any, sequence: str, tokens: list[int], new: int, start: int | None) -> None:
    """Hash the ``new`` blocks the last forward completed for ``sequence``, chained from
    ``start``; a block whose hash is held already is swapped for the held one
    (transformers' ``mark_complete_blocks``, seeded)."""
    page, ledger = allocator.tokens_per_page, allocator.ledger
    table = allocator.block_table[sequence]
    parent = start
    for i, block in enumerate(table):
        h = ledger.block_to_hash.get(block)
        if h is None:
            chunk = tokens[i * page : (i + 1) * page]
            if new == 0 or len(chunk) < page:
                break
            h = compute_block_hash(parent, chunk)
            new -= 1
            held = ledger.register_new_hash(block, h)
            if held is not None:
                ledger.acquire(held)
                table[i] = held
                if ledger.release(block):
                    allocator.pool.free_blocks(allocator.index, [block])
        parent = h


class SaltedSharing:
    """transformers' block sharing on ``cache`` (its ``PagedAttentionCache``), salted per
    sequence (module docstring). Installs itself in the cache's methods."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.salts: dict[str, int] = {}
        """Per salted sequence, the seed of its chain."""
        self.unshared: set[str] = set()
        """Sequences that take no prefix (scored)."""
        self.taken: dict[str, int] = {}
        """Per sequence begun, the prefix it took when it first began (a preempted one's own
        blocks coming back do not count), in tokens."""
        self.hit_tokens = 0
        """Prompt tokens taken from shared blocks so far (each one a prefill token saved)."""
        cache.search_prefix_match = self._search
        cache.mark_complete_blocks = self._mark
        self._store = cache.can_store_request_tokens
        cache.can_store_request_tokens = self._can_store

    @property
    def on(self) -> bool:
        """Whether the cache shares (every layer group is full attention)."""
        return bool(self.cache.use_prefix_sharing)

    def add(self, sequence: str, salt: Salt, shared: bool) -> None:
        """A sequence (re)added: its salt; ``shared`` False: it takes no prefix."""
        s = seed(salt)
        self.salts.pop(sequence, None)
        if s is not None:
            self.salts[sequence] = s
        self.unshared.discard(sequence)
        if not shared:
            self.unshared.add(sequence)

    def forget(self, sequence: str) -> None:
        self.salts.pop(sequence, None)
        self.unshared.discard(sequence)
        self.taken.pop(sequence, None)

    def clear(self) -> None:
        self.salts.clear()
        self.unshared.clear()
        self.taken.clear()

    def forget_blocks(self) -> int:
        """Forget every block's hash: no prompt finds one from now on. The cached ones go
        back to the pool; the held ones stay with their users, then go back unhashed. How
        many blocks were known."""
        known = 0
        for allocator in self.cache.cache_allocators.values():
            known += len(allocator.ledger.block_to_hash)
        self.cache.evict_cached_blocks()
        for allocator in self.cache.cache_allocators.values():
            allocator.ledger.hash_to_block.clear()
            allocator.ledger.block_to_hash.clear()
        return known

    def _seed(self, sequence: str) -> int | None:
        # transformers names a fork's children ``<parent>__child#i``: they share its salt
        return self.salts.get(sequence.split("__child#")[0])

    def _search(self, sequence: str, prompt: list[int]) -> int:
        if not self.on or sequence in self.unshared:
            return 0
        start = self._seed(sequence)
        found = {n: match(a, prompt, start) for n, a in self.cache.cache_allocators.items()}
        tokens: int = min(len(b) * self.cache.cache_allocators[n].tokens_per_page
                          for n, b in found.items())  # fmt: skip
        self.taken.setdefault(sequence, tokens)  # when it first began: not its own coming back
        if tokens > 0:
            for n, blocks in found.items():
                self.cache.cache_allocators[n].acquire_prefix_blocks(sequence, tokens, blocks)
            self.hit_tokens += tokens
        return tokens

    def _mark(self, state: Any, complete: dict[str, int]) -> None:
        # transformers skips a sequence that finished in this step (its table may be gone
        # in its async mode): then a prompt taking one token is never shared. Here the
        # table is looked for (this engine is synchronous: it goes after this call).
        tokens = state.initial_tokens + state.generated_tokens
        start = self._seed(state.request_id)
        for n, new in complete.items():
            allocator = self.cache.cache_allocators[n]
            if state.request_id in allocator.block_table:
                mark(allocator, state.request_id, tokens, new, start)

    def _can_store(self, state: Any, tokens: int, dry_run: bool = False) -> bool:
        """transformers' check, and when it fails, again after the blocks no sequence
        holds are evicted (kept only while nobody needs their room)."""
        if self._store(state, tokens, dry_run):
            return True
        if not self.cache.evict_cached_blocks():
            return False
        self.cache.pool.try_to_free_sectors()
        return bool(self._store(state, tokens, dry_run))
