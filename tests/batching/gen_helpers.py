"""Builders shared by the generation-policy tests (a plain module, like batching_helpers)."""

from __future__ import annotations

from batchfleet.batching.gen_types import GenPolicy, GenRunning, GenWaiting


def gw(
    key: str,
    arrived: float = 0.0,
    *,
    lane: int = 0,
    prompts: tuple[int, ...] = (10,),
    max_new: int = 16,
    deadline: float | None = None,
    parent: str | None = None,
) -> GenWaiting:
    return GenWaiting(key, lane, arrived, deadline, prompts, max_new, parent)


def gr(
    key: str,
    started: float = 0.0,
    *,
    lane: int = 0,
    contexts: tuple[int, ...] = (10,),
    prefill: tuple[int, ...] | None = None,
    arrived: float | None = None,
    deadline: float | None = None,
    max_new_left: int = 16,
    preempted: int = 0,
    seqs: tuple[int, ...] = (),
) -> GenRunning:
    return GenRunning(
        key,
        lane,
        started if arrived is None else arrived,
        deadline,
        started,
        contexts,
        prefill if prefill is not None else (0,) * len(contexts),
        max_new_left,
        preempted,
        seqs,
    )


def tokens_policy(
    kv: int = 100,
    *,
    page: int = 1,
    step: int = 1000,
    max_running: int = 16,
    watermark: float = 0.0,
    starvation_ms: float = 2000.0,
) -> GenPolicy:
    """A policy whose blocks are tokens (page 1) unless told, no watermark: easy sums."""
    return GenPolicy(
        kv_cache_tokens=kv,
        page_size=page,
        step_tokens=step,
        max_running=max_running,
        watermark=watermark,
        max_starvation_ms=starvation_ms,
    )
