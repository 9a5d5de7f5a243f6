"""Per-request sampling with per-request seeds, and the logits rules a request may set.

transformers' continuous batching samples with one global generator, so a request's text
would depend on its batch-mates. We run it greedy (``do_sample=False``) and put this
processor in its logits-processor list: for each row of a sequence registered here it
applies the request's rules, then picks a token (argmax, or a draw with that request's
own generator after temperature, top-k and top-p), and leaves only that token's logit
finite — the engine's argmax then picks it. Plain greedy rows (no rule, no temperature)
pass through untouched and cost nothing. The same request with the same seed therefore
gives the same tokens whatever else runs beside it. A sampled request without a seed
takes the next one of the worker's ``seed`` stream (vLLM's ``--seed``), else a random one.
The padded engine calls :meth:`SeededSampler.draw` per row instead.

The rules, applied in this order before temperature (as HF ``generate`` and vLLM do):

- ``repetition_penalty`` (HF's and vLLM's): the logit of every token already in the prompt
  or the output is divided by it when positive, multiplied when negative;
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI's and vLLM's): a token that the
  output holds ``n`` times loses ``presence + frequency * n`` from its logit (the prompt
  does not count);
- ``logit_bias`` (OpenAI's and vLLM's): added to the given tokens' logits (-100 bans a
  token, 100 all but forces it);
- ``min_new_tokens`` (HF's): the end-of-sequence tokens are masked until the sequence has
  generated that many tokens (a stop string still ends it);
- ``structured_outputs`` (vLLM's, :mod:`.grammar`): tokens the sequence's constraint does
  not allow next are masked (it overrides ``min_new_tokens`` where the two leave nothing).

A request with a ``thinking_token_budget`` (:mod:`.think_budget`) takes its reasoning's
end tag, token by token, in place of its pick once the budget is spent.

A request that asks for ``logprobs`` gets, per token, the chosen token's log-probability
and the likeliest tokens' under the model's own logits (before the rules and temperature:
vLLM's default), kept here until its end.

What a sequence generated is kept here with its generator; when it resumes after a
preemption the engine adds it again with its prompt and output, which this takes as the
truth (so a draw a failed step dropped is not counted).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from .grammar import Masks
from .think_budget import BudgetState, ThinkBudget

if TYPE_CHECKING:
    import llguidance

    from .grammar import Constraint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Marker:
    """Where a reasoning model's constraint begins: right after ``head``'s tokens (a
    ``</think>``), or, with ``tail``, after ``tail``'s tokens begun within ``gap`` tokens
    of ``head``'s end (gpt-oss: ``<|channel|>final`` … ``<|message|>``, a
    ``<|constrain|>json`` between allowed; vLLM's ``is_reasoning_end``)."""

    head: tuple[int, ...]
    tail: tuple[int, ...] = ()
    gap: int = 0

    @property
    def last(self) -> int:
        """The token that completes it."""
        return (self.tail or self.head)[-1]

    @property
    def span(self) -> int:
        """The most tokens it takes."""
        return len(self.head) + self.gap + len(self.tail)

    def end(self, out: Sequence[int]) -> int | None:
        """Where in ``out`` the text after its first occurrence begins (None: none yet)."""
        h, t = list(self.head), list(self.tail)
        for i in range(len(out) - len(h) + 1):
            if out[i] != h[0] or list(out[i : i + len(h)]) != h:
                continue
            j = i + len(h)
            if not t:
                return j
            for k in range(j, min(len(out) - len(t), j + self.gap) + 1):
                if list(out[k : k + len(t)]) == t:
                    return k + len(t)
        return None


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling parameters (``temperature`` 0: greedy) and logits rules."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits."""
    min_p: float = 0.0
    """Draw only tokens at least this fraction as likely as the likeliest (0: any)."""
    allowed_tokens: tuple[int, ...] = ()
    """Only these tokens are drawn (vLLM's ``allowed_token_ids``; empty: any)."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token sequences never completed: a sequence's last token is not drawn where the
    output ends with the rest of it (vLLM's ``bad_words``, HF's ``bad_words_ids``)."""
    ignore_eos: bool = False
    """An end-of-sequence token does not end the sequence (the engines read this)."""
    logprobs: int | None = None
    """Keep each token's log-probability and this many alternatives' (None: none)."""
    constraint: Constraint | None = None
    """The text follows it (``structured_outputs``; None: free)."""
    constraint_after: Marker | None = None
    """The constraint begins after this marker (a reasoning model's ``</think>``): the
    text before it is free (None: from the first token)."""
    constraint_unless: int | None = None
    """With ``constraint_after``: the constraint holds from the first token unless that
    token is this one (a reasoning model's ``<think>``, where the prompt leaves it to the
    model whether to think), which the first token may also be."""
    think: ThinkBudget | None = None
    """Its reasoning's budget (``thinking_token_budget``, :mod:`.think_budget`): spent, the
    end tag's tokens are forced (None: no cap)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def ruled(self) -> bool:
        """A rule changes its logits (a penalty, a bias, or ``min_new_tokens``)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_new_tokens > 0
            or bool(self.logit_bias)
            or bool(self.allowed_tokens)
            or bool(self.bad_words)
        )

    @property
    def shaped(self) -> bool:
        """Its logits change before the pick (a rule, or a constraint)."""
        return self.ruled or self.constraint is not None

    @property
    def only_constrained(self) -> bool:
        """Greedy, no rule, nothing kept: the argmax of its constraint's tokens."""
        return (self.constraint is not None and self.greedy and not self.ruled
                and self.logprobs is None and self.think is None)  # fmt: skip

    @property
    def plain(self) -> bool:
        """Greedy over the model's own logits, nothing kept, nothing forced: the engine's
        argmax alone."""
        return self.greedy and not self.shaped and self.logprobs is None and self.think is None


Logprob = tuple[int, float, list[int], list[float], int]
"""A generated token, its log-probability, the likeliest tokens' ids and theirs, and its
rank (vLLM's: 1 + the number of tokens strictly likelier)."""


@dataclass(slots=True)
class _Track:
    """One registered sequence: its rules, generator and (for rules) what it has seen."""

    sampling: Sampling
    gen: torch.Generator | None
    """None: greedy."""
    prompt: int
    """Prompt length, from its first add."""
    seen: set[int] = field(default_factory=set)
    """Prompt and output token ids (``repetition_penalty``)."""
    counts: Counter[int] = field(default_factory=Counter)
    """Output token counts (presence and frequency penalties)."""
    generated: int = 0
    logprobs: list[Logprob] = field(default_factory=list)
    """Per generated token (``Sampling.logprobs``)."""
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    """``Sampling.logit_bias`` as tensors (ids, biases), made at its first draw."""
    only: torch.Tensor | None = None
    """``Sampling.allowed_tokens`` as a tensor of ids, made at its first draw."""
    tail: list[int] = field(default_factory=list)
    """Its output's last tokens (``Sampling.bad_words``: as many as the longest less one)."""
    matcher: llguidance.LLMatcher | None = None
    """Where its output stands in its constraint (``Sampling.constraint``)."""
    opening: bool = False
    """Its next token is its first, which may also be ``Sampling.constraint_unless``."""
    recent: list[int] = field(default_factory=list)
    """While its constraint waits for ``Sampling.constraint_after``: its last tokens (as
    many as the marker may take)."""
    think: BudgetState | None = None
    """Where it stands in its reasoning's budget (``Sampling.think``)."""

    def restart(self, tokens: list[int]) -> None:
        """Its prompt and output as the engine was given them (first add or a resume)."""
        self.seen = set(tokens)
        self.counts = Counter(tokens[self.prompt :])
        self.generated = max(0, len(tokens) - self.prompt)
        del self.logprobs[self.generated :]  # drawn in a step that failed: not generated
        if self.sampling.think is not None:
            self.think = BudgetState.replay(self.sampling.think, tokens[self.prompt :])
        if self.sampling.bad_words:
            keep = max(len(w) for w in self.sampling.bad_words) - 1
            self.tail = tokens[self.prompt :][-keep:] if keep else []
        constraint = self.sampling.constraint
        if constraint is not None:  # back to the start, then through what it generated
            out = tokens[self.prompt :]
            after, unless = self.sampling.constraint_after, self.sampling.constraint_unless
            self.opening = unless is not None and not out
            if after is not None and (unless is None or out[:1] == [unless]):
                self.matcher = None  # it begins after the marker, once there is one
                at = after.end(out)
                if at is None:
                    self.recent = out[-after.span :]
                    return
                out = out[at:]
            self.matcher = constraint.matcher()
            if out:
                self.matcher.consume_tokens(out)

    def took(self, token: int) -> None:
        self.seen.add(token)
        self.counts[token] += 1
        self.generated += 1
        if self.sampling.bad_words:
            self.tail.append(token)
            keep = max(len(w) for w in self.sampling.bad_words) - 1
            del self.tail[: len(self.tail) - keep]

    def banned(self) -> list[int]:
        """The tokens that would complete one of its bad words now."""
        tail = self.tail
        return [w[-1] for w in self.sampling.bad_words
                if len(w) <= len(tail) + 1 and tail[len(tail) - len(w) + 1 :] == list(w[:-1])]  # fmt: skip


def _seed_source(seed: int | None) -> torch.Generator | None:
    """A generator seeded with ``seed`` (None: none)."""
    return None if seed is None else torch.Generator(device="cpu").manual_seed(seed)


class SeededSampler(ContinuousBatchingLogitsProcessor):  # type: ignore[misc]
    """Picks each registered sequence's token by its own rules and generator (see the
    module docstring)."""

    supported_kwargs: dict[str, type] = {}  # rows are known by request id
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None) -> None:
        self._tracks: dict[str, _Track] = {}
        self._rows: list[str] = []
        self._eos = sorted(set(eos_token_ids))
        self._masks: Masks | None = None
        """The constrained rows' bitmasks (made at the first)."""
        self._seed = seed
        self._seeds = _seed_source(seed)
        """Where the sampled sequences without a seed of their own take one (vLLM's
        ``--seed``; None: the OS's randomness)."""

    def add(self, sequence: str, sampling: Sampling, tokens: list[int] | None = None) -> None:
        """Register a sequence before it is scheduled, with what it prefills (``tokens``:
        its prompt, then on a resume its prompt and output); plain greedy ones need nothing.
        A sequence resumed after preemption keeps its generator, so its draws go on."""
        if sampling.plain:
            return
        track = self._tracks.get(sequence)
        if track is None:
            gen = None
            if not sampling.greedy:
                seed = sampling.seed
                if seed is None:
                    seed = self._unseeded()
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
            track = _Track(sampling, gen, prompt=len(tokens or ()))
            self._tracks[sequence] = track
        if sampling.shaped or sampling.logprobs is not None or sampling.think is not None:
            track.restart(list(tokens or ()))

    def forget(self, sequence: str) -> None:
        """The sequence ended."""
        self._tracks.pop(sequence, None)

    def logprobs(self, sequence: str) -> list[Logprob]:
        """What a sequence kept of its tokens' log-probabilities (empty: nothing asked)."""
        track = self._tracks.get(sequence)
        return [] if track is None else track.logprobs

    def clear(self) -> None:
        """Forget every sequence (the runner starts over, as a fresh worker: the sequences
        without a seed take theirs from the start of ``seed``'s stream again)."""
        self._tracks.clear()
        self._seeds = _seed_source(self._seed)

    def _unseeded(self) -> int:
        """A seed for a sampled sequence without one: the next of ``seed``'s stream, so a
        fresh worker given the same requests in the same order draws the same tokens
        (vLLM seeds its global generator so), else the OS's randomness."""
        if self._seeds is None:
            return int.from_bytes(os.urandom(8), "little")
        return int(torch.randint(0, 2**63 - 1, (1,), generator=self._seeds).item())

    def pick(self, sequences: Sequence[str], logits: torch.Tensor) -> list[int]:
        """Each row's next token: its sequence's own (registered), else the argmax. The
        constrained rows' masks are made together, and the rows whose only rule is their
        constraint (greedy, no log-probabilities) are masked and picked together."""
        tokens: list[int] = logits.argmax(dim=-1).tolist()
        tracks = self._tracks
        if not tracks:
            return tokens
        mine = [(i, t) for i, name in enumerate(sequences) if (t := tracks.get(name)) is not None]
        if not mine:
            return tokens
        held = [(i, t) for i, t in mine if t.matcher is not None]
        allowed = self._allowed([t for _, t in held], logits) if held else None
        row_of = {i: k for k, (i, _) in enumerate(held)}
        lean = [k for k, (_, t) in enumerate(held) if t.sampling.only_constrained]
        if lean:
            assert allowed is not None
            rows = [held[k][0] for k in lean]
            masked = logits[rows].float().masked_fill(~allowed[lean], float("-inf"))
            for i, token in zip(rows, masked.argmax(dim=-1).tolist(), strict=True):
                tokens[i] = token
                self._consume(sequences[i], tracks[sequences[i]], token)
        done = {held[k][0] for k in lean}
        for i, track in mine:
            if i not in done:
                k = row_of.get(i)
                tokens[i] = self._draw(sequences[i], track, logits[i],
                                       None if k is None or allowed is None else allowed[k])  # fmt: skip
        return tokens

    def forcing(self, sequence: str) -> bool:
        """Whether a sequence's next token is forced (its reasoning's budget is spent):
        drafts for it would all be refused."""
        track = self._tracks.get(sequence)
        return track is not None and track.think is not None and track.think.forced() is not None

    def draw(self, sequence: str, logits: torch.Tensor) -> int | None:
        """A registered sequence's next token from its ``logits`` row (None: plain greedy,
        the caller's argmax)."""
        track = self._tracks.get(sequence)
        if track is None:
            return None
        allowed = None if track.matcher is None else self._allowed([track], logits[None])[0]
        return self._draw(sequence, track, logits, allowed)

    def verify(self, sequence: str, logits: torch.Tensor, drafts: Sequence[int],
               stop: frozenset[int] = frozenset()) -> list[int]:  # fmt: skip
        """The tokens a sequence emits after its ``drafts`` ran through the model:
        ``logits`` has one row per position, the row before the first draft first and the
        row after the last draft last. The drafts the sequence's own pick agrees with, in
        order, then its own token where it first disagrees (or a bonus one after the
        last); nothing after a token of ``stop``. Greedy: the argmax of each position's
        processed logits, so exactly the tokens of one-at-a-time decoding. Sampled (vLLM's
        rejection sampling for a draft of probability one): draft ``x`` is accepted with
        probability ``p(x)`` under the processed distribution, else a token is drawn from
        ``p`` without ``x``, renormalized; each position's rules, constraint and
        log-probabilities see the tokens emitted before it."""
        track = self._tracks.get(sequence)
        if track is None:  # plain greedy: the argmax rows
            picks: list[int] = logits.argmax(dim=-1).tolist()
            out = []
            for j, token in enumerate(picks):
                out.append(token)
                if j == len(drafts) or token != drafts[j] or token in stop:
                    break
            return out
        out = []
        for j in range(len(drafts) + 1):
            row = logits[j]
            allowed = None if track.matcher is None else self._allowed([track], row[None])[0]
            draft = drafts[j] if j < len(drafts) else None
            token = self._draw(sequence, track, row, allowed, draft)
            out.append(token)
            if token != draft or token in stop:
                break
        return out

    def _draw(self, sequence: str, track: _Track, logits: torch.Tensor,
              allowed: torch.Tensor | None, draft: int | None = None) -> int:  # fmt: skip
        s = track.sampling
        raw = logits
        # a spent budget forces its end tag (not where a constraint already holds: the
        # constraint's text is not reasoning); its log-probability is still the model's
        forced = None if track.think is None or track.matcher is not None else track.think.forced()
        if forced is not None:
            token = forced
        else:
            if s.shaped:
                logits = self._shape(track, logits, allowed)
            if track.gen is None:
                token = int(logits.argmax())
            elif draft is None:
                token = sample(logits, s, track.gen)
            else:
                token = judge(logits, s, track.gen, draft)
        if s.logprobs is not None:
            track.logprobs.append(_logprob(raw, token, s.logprobs))
        if s.ruled:
            track.took(token)
        if track.think is not None:
            track.think.took(token)
        self._consume(sequence, track, token)
        return token

    @staticmethod
    def _consume(sequence: str, track: _Track, token: int) -> None:
        if track.opening:
            track.opening = False
            if token == track.sampling.constraint_unless:  # it thinks first
                track.matcher = None
                return
        if track.matcher is None:
            s, after = track.sampling, track.sampling.constraint_after
            if s.constraint is None or after is None:
                return
            recent = track.recent
            recent.append(token)
            del recent[: len(recent) - after.span]
            if token == after.last and after.end(recent) is not None:  # it begins
                track.matcher = s.constraint.matcher()
                recent.clear()
            return
        if not track.matcher.consume_token(token):
            logger.warning("sequence %s: its constraint refused token %d: %s", sequence, token,
                           track.matcher.get_error())  # fmt: skip

    def _shape(self, track: _Track, logits: torch.Tensor,
               allowed: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """A copy of ``logits`` (float32) with the track's rules applied, then its
        constraint's mask ``allowed``. Where the rules left none of what it allows
        (``min_new_tokens`` against a complete text), the constraint wins: its tokens keep
        their own logits."""
        s = track.sampling
        x = logits.float().clone()
        dev = x.device
        if s.repetition_penalty != 1.0 and track.seen:
            ids = torch.tensor(list(track.seen), dtype=torch.long, device=dev)
            v = x[ids]
            x[ids] = torch.where(v < 0, v * s.repetition_penalty, v / s.repetition_penalty)
        if (s.presence_penalty or s.frequency_penalty) and track.counts:
            ids = torch.tensor(list(track.counts), dtype=torch.long, device=dev)
            n = torch.tensor(list(track.counts.values()), dtype=x.dtype, device=dev)
            x[ids] -= s.frequency_penalty * n + s.presence_penalty
        if s.logit_bias:
            if track.bias is None:  # once per sequence
                ids = torch.tensor([t for t, _ in s.logit_bias], dtype=torch.long, device=dev)
                by = torch.tensor([b for _, b in s.logit_bias], dtype=x.dtype, device=dev)
                track.bias = (ids, by)
            x[track.bias[0]] += track.bias[1]
        if s.bad_words and (banned := track.banned()):
            x[torch.tensor(banned, dtype=torch.long, device=dev)] = float("-inf")
        if s.allowed_tokens:
            if track.only is None:
                track.only = torch.tensor(s.allowed_tokens, dtype=torch.long, device=dev)
            kept = x[track.only]
            x.fill_(float("-inf"))
            x[track.only] = kept
        if track.generated < s.min_new_tokens and self._eos:
            x[torch.tensor(self._eos, dtype=torch.long, device=dev)] = float("-inf")
        if allowed is not None:
            x.masked_fill_(~allowed, float("-inf"))
            if not bool(torch.isfinite(x).any()):
                x.copy_(logits.float().masked_fill(~allowed, float("-inf")))
        return x

    def _allowed(self, tracks: list[_Track], logits: torch.Tensor) -> torch.Tensor:
        """Per constrained track, the tokens its matcher allows next (bool, one row each,
        as wide as ``logits``); a matcher that refused a token allows only the end."""
        width = logits.shape[-1]
        out = torch.zeros((len(tracks), width), dtype=torch.bool)
        live = [k for k, t in enumerate(tracks) if not t.matcher.is_error()]  # type: ignore[union-attr]
        if live:
            constraint = tracks[live[0]].sampling.constraint
            assert constraint is not None
            vocab = constraint.vocab_size  # one tokenizer per sampler
            if self._masks is None or self._masks.vocab_size != vocab:
                self._masks = Masks(vocab)
            bits = self._masks.allowed([tracks[k].matcher for k in live])  # type: ignore[misc]
            cut = min(vocab, width)
            out[live, :cut] = bits[:, :cut]
        for k in set(range(len(tracks))) - set(live):
            out[k, self._eos] = True
        for k, t in enumerate(tracks):
            if t.opening:  # its first token may also open its reasoning
                out[k, t.sampling.constraint_unless] = True
        return out.to(logits.device)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        # The rows of the next __call__ are these requests, in this order.
        self._rows = [r.state.request_id for r in requests_with_new_token]
        return torch.zeros(len(self._rows), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = self._rows[: scores.shape[0]]
        if not self._tracks or not any(r in self._tracks for r in rows):
            return scores
        tokens = self.pick(rows, scores)
        for row, sequence in enumerate(rows):
            if sequence in self._tracks:
                scores[row].fill_(float("-inf"))
                scores[row, tokens[row]] = 0.0
        return scores


def _logprob(logits: torch.Tensor, token: int, top: int) -> Logprob:
    """``token``'s log-probability under ``logits`` and the ``top`` likeliest tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    rank = int((lp > lp[token]).sum()) + 1
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[0]))
        return token, float(lp[token]), ids.tolist(), values.tolist(), rank
    return token, float(lp[token]), [], [], rank


def logprob_rows(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """Per row of ``logits`` (positions), the log-probability of ``tokens[row]`` and the
    ``top`` likeliest tokens' and its rank (a prompt's tokens, each under the logits before
    it)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(len(tokens), device=lp.device)
    picked = lp[rows, torch.tensor(tokens, device=lp.device)]
    ranks = ((lp > picked[:, None]).sum(dim=-1) + 1).tolist()
    chosen = picked.tolist()
    if not top:
        return [(t, v, [], [], r) for t, v, r in zip(tokens, chosen, ranks, strict=True)]
    values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return [(t, v, i, w, r) for t, v, i, w, r in zip(tokens, chosen, ids.tolist(),
                                                    values.tolist(), ranks, strict=True)]  # fmt: skip


def sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    """One token from ``logits`` (1-D) by temperature, top-k, top-p and min-p (HF's order),
    drawn with ``gen``."""
    return int(torch.multinomial(distribution(logits, sampling), 1, generator=gen).item())


def judge(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator, draft: int) -> int:
    """A proposed token ``draft`` kept with its probability under :func:`distribution`,
    else a token drawn from that distribution without it (vLLM's rejection sampling of a
    draft of probability one: what it emits is distributed as :func:`sample`'s)."""
    probs = distribution(logits, sampling)
    u = float(torch.rand(1, generator=gen).item())
    if u < float(probs[draft]):
        return draft
    probs[draft] = 0.0
    if float(probs.sum()) <= 0.0:  # rounding: nothing else is possible
        return draft
    return int(torch.multinomial(probs, 1, generator=gen).item())


def distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The probabilities :func:`sample` draws from (1-D, float32, on the CPU)."""
    x = logits.float().cpu() / max(sampling.temperature, 1e-5)
    if 0 < sampling.top_k < x.shape[0]:
        kth = torch.topk(x, sampling.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > sampling.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if sampling.min_p > 0.0:  # the likeliest token always stays
        probs = probs.masked_fill(probs < sampling.min_p * probs.max(), 0.0)
    return probs
