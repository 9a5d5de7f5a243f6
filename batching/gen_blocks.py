"""KV memory and the step's token budget, counted as the KV cache counts them.

Memory is in whole blocks of ``page_size`` tokens per sequence. A running sequence
*reserves* ``blocks(context + prefill_left + 1)``: all of its prompt and the next token (so
a request admitted with its whole prompt's blocks is never preempted half-prefilled by its
own prefill); that is at least what the next step writes, whatever chunk it prefills.
Admission reserves the same for a new request's sequences, so after a plan the next
step's KV need (:func:`step_blocks`) never exceeds the cache. The step's token budget is
shared by :func:`schedule_step`: one token per decoding sequence, the rest in prefill
chunks, higher lanes first.
"""

from __future__ import annotations

from collections.abc import Sequence

from .gen_types import GenRunning, GenWaiting


def blocks_for(tokens: int, page_size: int) -> int:
    """KV blocks one sequence of ``tokens`` tokens holds (whole blocks)."""
    return -(-max(tokens, 0) // page_size)


def reserved_blocks(r: GenRunning, page_size: int) -> int:
    """Blocks a running request needs through the next step: each sequence's whole
    prompt plus one token (at least what the step writes, whatever the chunk)."""
    if len(r.contexts) == 1:  # the common case, planned for every running request each step
        return -(-(r.contexts[0] + r.prefill_left[0] + 1) // page_size)
    return sum(
        blocks_for(c + p + 1, page_size) for c, p in zip(r.contexts, r.prefill_left, strict=True)
    )


def outgrew(r: GenRunning, page_size: int, total: int) -> bool:
    """Whether ``r`` can never fit the cache of ``total`` blocks again: the smallest unit
    it is preempted by (a named sequence, else the request whole) reserves more."""
    if r.seqs:
        return any(
            blocks_for(c + p + 1, page_size) > total
            for c, p in zip(r.contexts, r.prefill_left, strict=True)
        )
    return reserved_blocks(r, page_size) > total


def admission_blocks(w: GenWaiting, page_size: int) -> int:
    """Blocks a waiting request needs to start: whole prompts plus one decode token (none
    for a sequence of no prompt tokens: its runner answers it when admitted)."""
    if len(w.prompts) == 1:
        return -(-(w.prompts[0] + 1) // page_size) if w.prompts[0] else 0
    return sum(blocks_for(p + 1, page_size) for p in w.prompts if p)


def schedule_step(running: Sequence[GenRunning], step_tokens: int) -> dict[str, tuple[int, ...]]:
    """Tokens each sequence feeds the next step (key → per sequence, in order).

    Every decoding sequence takes one token; what is left of ``step_tokens`` goes to
    prefill chunks of the prefilling sequences in lane order, then by ``started_at``
    (then key), each taking what it still needs or what is left. The worker calls this
    on the running batch after applying a plan (an admitted request is running with
    ``contexts`` of 0 and ``prefill_left`` = its prompts).
    """
    decodes = sum(1 for r in running for p in r.prefill_left if p == 0)
    left = max(step_tokens - decodes, 0)
    out: dict[str, tuple[int, ...]] = {}
    for r in sorted(running, key=lambda r: (r.lane, r.started_at, r.key)):
        chunks: list[int] = []
        for p in r.prefill_left:
            if p == 0:
                chunks.append(1)
            else:
                take = min(p, left)
                left -= take
                chunks.append(take)
        out[r.key] = tuple(chunks)
    return out


def step_blocks(
    running: Sequence[GenRunning], chunks: dict[str, tuple[int, ...]], page_size: int
) -> int:
    """KV blocks the step needs: each sequence's context plus what it adds."""
    return sum(
        blocks_for(c + a, page_size)
        for r in running
        for c, a in zip(r.contexts, chunks.get(r.key, ()), strict=True)
    )
