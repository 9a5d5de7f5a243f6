"""The chaos run's greedy check (``bench.gen_chaos``): a greedy answer's tokens against
one-at-a-time greedy decoding of the same model, with a stated tolerance for float32 ties.

The reference decodes the answer's prompt one sequence at a time with a KV cache, fed
the answer's own tokens (teacher-forced), and at each step notes its argmax and how far
the answer's token's logit lies below the top one. A token that is not the argmax is a
violation, unless that gap is at most :data:`TIE_EPS`: then the two were tied within
float32 rounding (a batched step sums in another order and may break the tie the other
way; seen once: top two logits 2.1e-6 apart, bench/results/gen-chaos-2026-12-07.md).
Such a step is accepted and reported apart, never silently. Being teacher-forced, the
steps after it are checked too (an untied divergence there is still a violation), where
comparing against free-running decoding would lose every step after the first
difference. vLLM's HF comparisons (``check_logprobs_close`` in its tests/models/utils.py)
are looser: at the first differing token each side's token need only be among the other's
top few log-probabilities, and nothing after it is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfleet.schemas.results import Result

TIE_EPS = 1e-4
"""The largest gap (in logits, the same as in log-probabilities) between the reference's
top logit and that of the answer's token for which a differing token counts as a tie:
50x the gap seen, and well below a real choice's: on the chaos model (hidden 256, 4
layers), over 768 greedy steps from 12 random prompts, the top two logits were a median
0.10 apart, 1.8e-3 at the 1st percentile, and below 1e-4 once (5.5e-6)."""


@dataclass(frozen=True)
class RefStep:
    """One step of the reference decoding: its argmax, and how far below the top logit the
    answer's token's logit lies (0 where it is the argmax)."""

    best: int
    gap: float


@dataclass(frozen=True)
class Verdict:
    """How a greedy answer compares: the first step where it broke greedy decoding (None:
    nowhere), and the steps accepted as ties, each (step, gap)."""

    bad: int | None
    ties: tuple[tuple[int, float], ...]


def judge(tokens: Sequence[int], steps: Sequence[RefStep], eps: float = TIE_EPS) -> Verdict:
    """Compare an answer's ``tokens`` with the reference ``steps`` taken along them."""
    if len(steps) != len(tokens):
        raise ValueError(f"{len(steps)} reference steps for {len(tokens)} tokens")
    ties: list[tuple[int, float]] = []
    for k, (token, step) in enumerate(zip(tokens, steps, strict=True)):
        if token == step.best:
            continue
        if step.gap > eps:
            return Verdict(k, tuple(ties))
        ties.append((k, step.gap))
    return Verdict(None, tuple(ties))


def reference_steps(lm: Any, prompt: list[int], tokens: list[int], torch: Any) -> list[RefStep]:
    """Greedy decoding of ``prompt``, one sequence, with a KV cache, fed ``tokens``: each
    step's argmax and the gap below its top logit of the token fed."""
    out: list[RefStep] = []
    ids, cache = torch.tensor([prompt]), None
    with torch.no_grad():
        for token in tokens:
            step = lm(input_ids=ids, cache=cache, use_cache=True)
            cache = step.cache
            logits = step.logits[0, -1].float()
            top, best = logits.max(dim=-1)
            out.append(RefStep(int(best), float(top - logits[token])))
            ids = torch.tensor([[token]])
    return out


def check_greedy(model: Path, chosen: list[Result], report: Any) -> None:
    """Greedy answers against one-at-a-time greedy decoding of the same model (argmax
    each step, on past EOS as ``ignore_eos`` does): the tokens a worker gave are its
    prefix (a stop, a cancel, an EOS or a deadline cuts it), however often regenerated;
    a token differing at a float32 tie (:data:`TIE_EPS`) is reported apart
    (``report.ties``), not a violation. ``report``: a ``gen_chaos_checks.Report``."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    for res in chosen:
        (g,) = res.generations()
        if g.completion_tokens == 0:  # cancelled while waiting: no tokens, no ids given
            continue
        if g.token_ids is None or g.prompt_token_ids is None:
            report.bad(res.id, "no token ids in the result")
            continue
        steps = reference_steps(lm, g.prompt_token_ids, g.token_ids, torch)
        report.counts["greedy answers checked against generate"] += 1
        judged(res.id, g.token_ids, steps, report)


def judged(rid: str, tokens: list[int], steps: list[RefStep], report: Any) -> Verdict:
    """Put one answer's verdict in ``report``: a violation where it broke greedy decoding,
    a line in ``report.ties`` per tie accepted."""
    verdict = judge(tokens, steps)
    for k, gap in verdict.ties:
        report.ties.append(f"{rid}: token {k} is {tokens[k]}, one at a time gives "
                           f"{steps[k].best}, {gap:.2g} below it (a tie)")  # fmt: skip
    if verdict.ties:
        report.counts["greedy answers with a tie broken otherwise"] += 1
    if verdict.bad is not None:
        k = verdict.bad
        report.bad(rid, f"greedy token {k} is {tokens[k]}, one at a time gives {steps[k].best} "
                        f"({steps[k].gap:.2g} below its top logit): {tokens}")  # fmt: skip
    return verdict
